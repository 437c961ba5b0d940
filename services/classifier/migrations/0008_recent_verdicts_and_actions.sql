-- The console's fleet view asks for the verdicts and actions of the last hour. Without an index
-- on their times each request read every row: 0.7 s with a million verdicts (docs/benchmarks.md,
-- "Console"). Both tables grow by one row per decision or outcome, so the indexes cost the
-- classifier's writes little.
CREATE INDEX verdicts_issued_at ON verdicts (issued_at);
CREATE INDEX actions_at ON actions (at);
