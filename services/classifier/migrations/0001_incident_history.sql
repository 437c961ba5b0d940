-- gpumedic's incident history. The classifier is the only writer, and every write is idempotent:
-- keyed by event id, incident id, verdict id, so a redelivered record changes nothing.

-- Every health event the classifier has seen, raw or enriched, with the fields people filter on
-- as columns and the whole record as JSON.
CREATE TABLE health_events (
    event_id     uuid        PRIMARY KEY,
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
    record       jsonb       NOT NULL,
    recorded_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX health_events_node_time ON health_events (node, observed_at DESC);
CREATE INDEX health_events_xid ON health_events (xid, observed_at DESC) WHERE xid IS NOT NULL;

-- An incident: one fault on one node (or GPU), from its first verdict to its recovery.
CREATE TABLE incidents (
    incident_id  uuid        PRIMARY KEY,
    node         text        NOT NULL,
    gpu_uuid     text,
    rule_id      text        NOT NULL,
    severity     text        NOT NULL CHECK (severity IN ('critical', 'warning', 'info')),
    opened_at    timestamptz NOT NULL,
    resolved_at  timestamptz,
    summary      text        NOT NULL
);
CREATE INDEX incidents_node_time ON incidents (node, opened_at DESC);
CREATE INDEX incidents_open ON incidents (node) WHERE resolved_at IS NULL;

-- Every verdict published on gpumedic.verdicts.v1.
CREATE TABLE verdicts (
    verdict_id    uuid        PRIMARY KEY,
    incident_id   uuid        NOT NULL REFERENCES incidents (incident_id),
    node          text        NOT NULL,
    gpu_uuid      text,
    severity      text        NOT NULL CHECK (severity IN ('critical', 'warning', 'info')),
    rule_id       text        NOT NULL,
    rule_version  integer     NOT NULL,
    action        text        NOT NULL,
    reason        text        NOT NULL,
    recovery      boolean     NOT NULL DEFAULT false,
    evidence      uuid[]      NOT NULL DEFAULT '{}',
    issued_at     timestamptz NOT NULL
);
CREATE INDEX verdicts_incident ON verdicts (incident_id, issued_at);

-- What the remediator did about each verdict, from gpumedic.actions.v1.
CREATE TABLE actions (
    verdict_id  uuid        NOT NULL,
    action      text        NOT NULL,
    status      text        NOT NULL,
    detail      text        NOT NULL DEFAULT '',
    at          timestamptz NOT NULL,
    PRIMARY KEY (verdict_id, action, status)
);
