-- One NVLink root fault across the nodes of an NVLink domain (docs/decisions.md, principle 9). When
-- one GPU's link goes down, its peers in the same domain log sympathetic errors (Xid 145) within
-- seconds, on other nodes too (a GB200 NVL72 is 72 GPUs over 18 nodes). Nodes are spread over
-- classifier replicas, so the root incident is found here, by domain, not in any replica's memory.

-- The NVLink domain (clique) of the root GPU, on incidents that can be the root of sympathetic
-- errors on other nodes (an NVLink fault opened by evidence that is not itself sympathetic); NULL
-- on every other incident.
ALTER TABLE incidents ADD COLUMN nvlink_domain text;
CREATE INDEX incidents_nvlink_domain ON incidents (nvlink_domain, opened_at) WHERE nvlink_domain IS NOT NULL;

-- A sympathetic event recorded as evidence on another GPU's root incident instead of opening an
-- incident of its own: which peer (node, GPU) logged it, and which root (node, GPU, rule) it
-- echoes. The event id makes a retried batch or a replay record nothing twice; a rebuild replays
-- these decisions as they were made. No foreign key to incidents: the root may be written by
-- another replica, or by a concurrent write of the same batch.
CREATE TABLE sympathetic_evidence (
    event_id       uuid        PRIMARY KEY,
    incident_id    uuid        NOT NULL,
    node           text        NOT NULL,
    gpu_uuid       text,
    at             timestamptz NOT NULL,
    root_rule_id   text        NOT NULL,
    root_node      text        NOT NULL,
    root_gpu_uuid  text,
    root_opened_at timestamptz NOT NULL,
    recorded_at    timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX sympathetic_evidence_incident ON sympathetic_evidence (incident_id, at);
