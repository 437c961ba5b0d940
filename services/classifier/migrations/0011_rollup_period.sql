-- Rollups per `--rollup-period` (10 minutes by default, from 1 minute to 1 hour), not per minute
-- only: the collector's heartbeat is one a minute per GPU, so a rollup per minute held one event
-- (docs/incident-history.md). `minute` keeps its name (queries use it) and is the start of the
-- row's period; `period` is its length, so `minute + period` is its end. Rows written before this
-- column were per minute.
ALTER TABLE telemetry_rollups ADD COLUMN period interval NOT NULL DEFAULT interval '1 minute';
