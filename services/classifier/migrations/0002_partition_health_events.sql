-- health_events becomes a table range-partitioned by observed_at, one partition per UTC day
-- (health_events_pYYYYMMDD) plus a DEFAULT partition for events outside every daily one, so old
-- events are dropped a whole day at a time (the classifier's retention job) instead of deleted
-- row by row. The primary key must include the partition key: (event_id, observed_at). An event
-- always carries the same observed_at, so a redelivered event still conflicts and is skipped.
-- Incidents, verdicts and actions are small and are kept; they are not partitioned.
--
-- `record` becomes `json` (was `jsonb`): the whole record is kept for rebuilds and for people,
-- and is rarely searched, while parsing it into jsonb was half the cost of inserting an event.
-- `->` and `->>` work as before; cast to jsonb (`record::jsonb @> ...`) for jsonb's operators.

ALTER TABLE health_events RENAME TO health_events_unpartitioned;
ALTER INDEX health_events_pkey RENAME TO health_events_unpartitioned_pkey;
ALTER INDEX health_events_node_time RENAME TO health_events_unpartitioned_node_time;
ALTER INDEX health_events_xid RENAME TO health_events_unpartitioned_xid;

CREATE TABLE health_events (
    event_id     uuid        NOT NULL,
    node         text        NOT NULL,
    observed_at  timestamptz NOT NULL,
    source       text        NOT NULL,
    component    text        NOT NULL,
    kind         text        NOT NULL,
    gpu_uuid     text,
    pci_bus_id   text,
    xid          integer,
    healthy      boolean     NOT NULL DEFAULT false,
    synthetic    boolean     NOT NULL DEFAULT false,
    record       json        NOT NULL,
    recorded_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (event_id, observed_at)
) PARTITION BY RANGE (observed_at);

-- The same indexes as before, now on every partition: by node and time (the API, rebuilds), by
-- Xid (history queries). Lookups by event id alone (an incident's evidence) use the primary key.
CREATE INDEX health_events_node_time ON health_events (node, observed_at DESC);
CREATE INDEX health_events_xid ON health_events (xid, observed_at DESC) WHERE xid IS NOT NULL;

CREATE TABLE health_events_default PARTITION OF health_events DEFAULT;

-- A daily partition for every day that has events, and for today and the next three days (the
-- retention job keeps creating them ahead from then on).
DO $$
DECLARE
    day date;
BEGIN
    FOR day IN
        SELECT DISTINCT (observed_at AT TIME ZONE 'UTC')::date FROM health_events_unpartitioned
        UNION
        SELECT ((now() AT TIME ZONE 'UTC')::date + n) FROM generate_series(0, 3) AS n
    LOOP
        EXECUTE format(
            'CREATE TABLE %I PARTITION OF health_events FOR VALUES FROM (%L) TO (%L)',
            'health_events_p' || to_char(day, 'YYYYMMDD'),
            day::timestamp AT TIME ZONE 'UTC',
            (day + 1)::timestamp AT TIME ZONE 'UTC');
    END LOOP;
END
$$;

INSERT INTO health_events (event_id, node, observed_at, source, component, kind, gpu_uuid, pci_bus_id, xid, healthy,
                           synthetic, record, recorded_at)
SELECT event_id, node, observed_at, source, component, kind, gpu_uuid, pci_bus_id, xid, healthy, synthetic,
       record::json, recorded_at
  FROM health_events_unpartitioned;
DROP TABLE health_events_unpartitioned;
