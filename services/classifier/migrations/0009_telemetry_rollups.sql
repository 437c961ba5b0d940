-- Per-minute rollups of the healthy telemetry the classifier does not record event by event
-- (`--persist evidence`, docs/incident-history.md): one row per node, GPU ('' for the node),
-- kind and minute, with each reading's minimum, maximum and last value and each counter's growth.
-- A row is written once its minute is over; a late event's rollup is merged into it.
CREATE TABLE telemetry_rollups (
    node      text        NOT NULL,
    gpu_uuid  text        NOT NULL DEFAULT '',
    kind      text        NOT NULL,
    minute    timestamptz NOT NULL,
    events    integer     NOT NULL,
    last_at   timestamptz NOT NULL,
    -- {"value": {"min": 58, "max": 70, "last": 64}, ...}
    readings  jsonb       NOT NULL DEFAULT '{}',
    -- {"single_bit_aggregate": 2, ...}: growth within the minute (a reset counts from zero)
    counters  jsonb       NOT NULL DEFAULT '{}',
    PRIMARY KEY (node, gpu_uuid, kind, minute)
);
-- Retention deletes by time.
CREATE INDEX telemetry_rollups_minute ON telemetry_rollups (minute);

-- Two rollups of one minute as one: the least minimum, the greatest maximum, the last value of
-- the later one (`b_later`).
CREATE FUNCTION merge_rollup_readings(a jsonb, b jsonb, b_later boolean) RETURNS jsonb
LANGUAGE sql IMMUTABLE AS $$
    SELECT coalesce(jsonb_object_agg(k, CASE
               WHEN a -> k IS NULL THEN b -> k
               WHEN b -> k IS NULL THEN a -> k
               ELSE jsonb_build_object(
                   'min', least((a -> k ->> 'min')::float8, (b -> k ->> 'min')::float8),
                   'max', greatest((a -> k ->> 'max')::float8, (b -> k ->> 'max')::float8),
                   'last', CASE WHEN b_later THEN b -> k -> 'last' ELSE a -> k -> 'last' END)
           END), '{}'::jsonb)
      FROM (SELECT jsonb_object_keys(a) AS k UNION SELECT jsonb_object_keys(b)) keys
$$;

-- Two rollups' counter growths of one minute as one: their sum.
CREATE FUNCTION merge_rollup_counters(a jsonb, b jsonb) RETURNS jsonb
LANGUAGE sql IMMUTABLE AS $$
    SELECT coalesce(jsonb_object_agg(k, coalesce((a ->> k)::bigint, 0) + coalesce((b ->> k)::bigint, 0)), '{}'::jsonb)
      FROM (SELECT jsonb_object_keys(a) AS k UNION SELECT jsonb_object_keys(b)) keys
$$;
