//! Telemetry: one `init` for every service. An env-filter, text or JSON logs, OTLP trace export
//! when an endpoint is set, the W3C trace-context propagator for Kafka headers, and panics logged.

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::{EnvFilter, Layer as _};

use crate::config::{CommonConfig, LogFormat};

/// What went wrong while starting telemetry.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    /// The OTLP exporter could not be built.
    #[error("cannot build the OTLP trace exporter for {endpoint}: {source}")]
    Exporter {
        /// The configured endpoint.
        endpoint: String,
        /// The exporter's error.
        source: opentelemetry_otlp::ExporterBuildError,
    },
    /// A global subscriber was already installed.
    #[error("a tracing subscriber is already installed: {0}")]
    AlreadyInstalled(#[from] tracing_subscriber::util::TryInitError),
}

/// Flushes and stops trace export when dropped; keep it alive for the life of the process.
#[must_use = "dropping the guard stops trace export"]
pub struct TelemetryGuard {
    provider: Option<SdkTracerProvider>,
}

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        if let Some(provider) = self.provider.take()
            && let Err(e) = provider.shutdown()
        {
            eprintln!("trace export did not shut down cleanly: {e}");
        }
    }
}

/// Installs the global tracing subscriber for `service`. Must run inside a tokio runtime when an
/// OTLP endpoint is configured (the gRPC exporter uses it).
pub fn init(service: &'static str, config: &CommonConfig) -> Result<TelemetryGuard, TelemetryError> {
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());

    // The filter was validated with the config; fall back to `info` rather than fail here.
    let filter = EnvFilter::try_new(&config.log).unwrap_or_else(|_| EnvFilter::new("info"));
    let fmt_layer = match config.log_format {
        LogFormat::Text => tracing_subscriber::fmt::layer().with_target(true).boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer().json().flatten_event(true).with_current_span(true).boxed(),
    };

    let (otel_layer, provider) = match &config.otlp_endpoint {
        Some(endpoint) => {
            let exporter = opentelemetry_otlp::SpanExporter::builder()
                .with_tonic()
                .with_endpoint(endpoint.clone())
                .build()
                .map_err(|source| TelemetryError::Exporter { endpoint: endpoint.clone(), source })?;
            let provider = SdkTracerProvider::builder()
                .with_batch_exporter(exporter)
                .with_resource(opentelemetry_sdk::Resource::builder().with_service_name(service).build())
                .build();
            opentelemetry::global::set_tracer_provider(provider.clone());
            let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer(service));
            (Some(layer), Some(provider))
        }
        None => (None, None),
    };

    tracing_subscriber::registry().with(filter).with(fmt_layer).with(otel_layer).try_init()?;
    install_panic_hook();
    Ok(TelemetryGuard { provider })
}

/// Logs panics through tracing (so JSON logs carry them) before the default hook prints them.
fn install_panic_hook() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let location = info.location().map(|l| format!("{}:{}", l.file(), l.line())).unwrap_or_default();
        let payload = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_default();
        tracing::error!(%location, panic = %payload, "A task panicked; the service is shutting down.");
        default(info);
    }));
}
