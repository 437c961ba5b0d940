-- Views over the incident history, documented with example queries in docs/incident-history.md.
-- Plain SQL for operators, dashboards and the CLI; they read, never write.

-- One row per incident: where, which rule, how bad, when it opened and resolved, how long it took,
-- how many verdicts it had, and the last thing the remediator did about it.
CREATE VIEW incident_history AS
SELECT i.incident_id,
       i.node,
       i.gpu_uuid,
       i.rule_id,
       i.severity,
       i.summary,
       i.opened_at,
       i.resolved_at,
       i.resolved_at - i.opened_at AS time_to_resolve,
       i.resolved_at IS NULL AS open,
       (SELECT count(*) FROM verdicts v WHERE v.incident_id = i.incident_id) AS verdicts,
       last_action.action AS last_action,
       last_action.status AS last_action_status,
       last_action.at AS last_action_at
  FROM incidents i
  LEFT JOIN LATERAL (
        SELECT a.action, a.status, a.at
          FROM actions a
          JOIN verdicts v USING (verdict_id)
         WHERE v.incident_id = i.incident_id
         ORDER BY a.at DESC, a.action DESC
         LIMIT 1
       ) last_action ON true;

-- Incidents opened per node in the last 30 days, by severity, with how many are still open.
CREATE VIEW incidents_per_node_30d AS
SELECT node,
       count(*) AS incidents,
       count(*) FILTER (WHERE severity = 'critical') AS critical,
       count(*) FILTER (WHERE severity = 'warning') AS warning,
       count(*) FILTER (WHERE severity = 'info') AS info,
       count(*) FILTER (WHERE resolved_at IS NULL) AS open,
       min(opened_at) AS first_opened_at,
       max(opened_at) AS last_opened_at
  FROM incidents
 WHERE opened_at > now() - interval '30 days'
 GROUP BY node;

-- Time to resolve by fault kind (the rule that opened the incident names the fault): over
-- resolved incidents, the mean, median and worst, beside how many are still open.
CREATE VIEW mttr_by_fault_kind AS
SELECT rule_id,
       count(*) FILTER (WHERE resolved_at IS NOT NULL) AS resolved,
       count(*) FILTER (WHERE resolved_at IS NULL) AS open,
       avg(resolved_at - opened_at) AS mean_time_to_resolve,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY resolved_at - opened_at) AS median_time_to_resolve,
       max(resolved_at - opened_at) AS max_time_to_resolve
  FROM incidents
 GROUP BY rule_id;

-- Nodes where the same fault came back: two or more incidents of one rule in the last 30 days.
CREATE VIEW repeat_fault_nodes AS
SELECT node,
       rule_id,
       count(*) AS incidents,
       min(opened_at) AS first_opened_at,
       max(opened_at) AS last_opened_at
  FROM incidents
 WHERE opened_at > now() - interval '30 days'
 GROUP BY node, rule_id
HAVING count(*) >= 2;

-- What was done for each incident: every verdict (what the classifier recommended) with every
-- outcome the remediator reported for it; a verdict nothing was done about has NULL action.
CREATE VIEW incident_actions AS
SELECT v.incident_id,
       v.node,
       v.verdict_id,
       v.issued_at,
       v.severity,
       v.action AS recommended_action,
       v.recovery,
       a.action,
       a.status,
       a.detail,
       a.at
  FROM verdicts v
  LEFT JOIN actions a USING (verdict_id);
