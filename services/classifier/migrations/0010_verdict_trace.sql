-- The trace id of each verdict's record (from the traceparent it was published with), so the
-- incident page and `gpumedic incidents --id` can link a verdict to its trace when OTLP is on.
-- Null for verdicts written before this column, and for those written outside the batch path.
ALTER TABLE verdicts ADD COLUMN trace_id text;
