package io.gpumedic.testbed.registry;

import io.apicurio.common.apps.config.DynamicConfigPropertyList;
import javax.enterprise.context.ApplicationScoped;
import javax.enterprise.inject.Produces;
import java.util.List;

/**
 * Stands in for Apicurio's config-index Quarkus extension, whose build-time half is not on Maven
 * Central: that extension lists the settings an administrator may change at run time. The testbed
 * changes none, so the list is empty and every setting keeps its startup value.
 */
@ApplicationScoped
public class DynamicConfigProperties {
    @Produces
    @ApplicationScoped
    DynamicConfigPropertyList dynamicConfigProperties() {
        return new DynamicConfigPropertyList(List.of());
    }
}
