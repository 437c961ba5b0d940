-- The whole verdict as published, kept with its row, so the remediator's resync can act on an open
-- incident's latest verdict exactly as it was issued (docs/pipeline.md, "Convergence"). Rows
-- written before this migration have no record; the resync skips them and says so.
ALTER TABLE verdicts ADD COLUMN record json;

-- The resync asks for the open incidents of the fleet and their latest verdict each.
CREATE INDEX verdicts_incident_latest ON verdicts (incident_id, issued_at DESC) WHERE NOT recovery;
