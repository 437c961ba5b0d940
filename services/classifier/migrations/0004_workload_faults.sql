-- Workload faults (docs/decisions.md, "Workload faults"): the same application-class Xid on GPUs of
-- several nodes that share a workload, within a short window, is the workload's fault, not the
-- GPUs'. Every classifier replica records its sightings here; the replica that sees the workload
-- reach the node threshold records the fault once (under an advisory lock per workload) and
-- publishes it on the verdict topic.

-- One application-class Xid seen on a GPU running a workload. The event id makes a retried batch
-- or a replay record nothing twice.
CREATE TABLE workload_fault_sightings (
    event_id    uuid PRIMARY KEY,
    workload    text NOT NULL,
    node        text NOT NULL,
    gpu_uuid    text,
    xid         integer NOT NULL,
    observed_at timestamptz NOT NULL
);
CREATE INDEX workload_fault_sightings_by_workload ON workload_fault_sightings (workload, observed_at);

-- One row per workload fault: which workload, which Xids on which nodes, from when to when, and the
-- verdict it was published as.
CREATE TABLE workload_faults (
    fault_id    uuid PRIMARY KEY,
    workload    text NOT NULL,
    xids        integer[] NOT NULL,
    nodes       text[] NOT NULL,
    gpus        integer NOT NULL,
    first_seen  timestamptz NOT NULL,
    last_seen   timestamptz NOT NULL,
    verdict_id  uuid NOT NULL,
    recorded_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX workload_faults_by_workload ON workload_faults (workload, last_seen);
