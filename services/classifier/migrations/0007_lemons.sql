-- Lemons (docs/decisions.md, "Lemons"): a node or GPU with too many hardware-class incidents within
-- a window is taken out for good. The classifier counts the hardware-class incidents of a node and
-- of a GPU (by UUID, which follows the GPU to another node) from this table, and records a lemon
-- as an incident of its own (rule `lemon-gpu` or `lemon-node`) that never recovers by itself.

-- True when one of the incident's decisions was hardware class: critical, with a repair (reset,
-- reboot, contact support, replace) as its action or a follow-up. Rows from before this migration
-- read false: history starts counting here.
ALTER TABLE incidents ADD COLUMN hardware boolean NOT NULL DEFAULT false;
CREATE INDEX incidents_hardware_node ON incidents (node, opened_at) WHERE hardware;
CREATE INDEX incidents_hardware_gpu ON incidents (gpu_uuid, opened_at) WHERE hardware AND gpu_uuid IS NOT NULL;

-- Every lemon the classifier declared: the part (a GPU, or the whole node), whether it is still
-- out, why (the reason lists the incidents that made it one), and the hardware-class incidents of
-- that part in the 30 days before it was declared (the default window; the classifier's
-- --lemon-window decides, the view only shows), oldest first, as JSON.
CREATE VIEW lemons AS
SELECT l.incident_id,
       CASE WHEN l.rule_id = 'lemon-gpu' THEN 'gpu' ELSE 'node' END AS part,
       l.node,
       l.gpu_uuid,
       l.opened_at AS declared_at,
       l.resolved_at,
       l.resolved_at IS NULL AS open,
       l.summary AS reason,
       history.incidents AS hardware_incidents,
       history.list AS history
  FROM incidents l
  LEFT JOIN LATERAL (
        SELECT count(*) AS incidents,
               coalesce(json_agg(json_build_object('incident_id', h.incident_id, 'node', h.node,
                                                   'gpu_uuid', h.gpu_uuid, 'rule_id', h.rule_id,
                                                   'opened_at', h.opened_at, 'resolved_at', h.resolved_at)
                                 ORDER BY h.opened_at), '[]'::json) AS list
          FROM incidents h
         WHERE h.hardware
           AND h.opened_at <= l.opened_at
           AND h.opened_at > l.opened_at - interval '30 days'
           AND CASE WHEN l.rule_id = 'lemon-gpu' THEN h.gpu_uuid = l.gpu_uuid ELSE h.node = l.node END
       ) history ON true
 WHERE l.rule_id IN ('lemon-gpu', 'lemon-node');

-- Hardware-class incidents per node and per GPU in the last 30 days: the parts closest to being
-- lemons, before they are. A GPU seen on several nodes (moved) lists them, comma-separated.
CREATE VIEW hardware_incidents_30d AS
SELECT 'node' AS part, node, NULL::text AS gpu_uuid, count(*) AS incidents, max(opened_at) AS last_opened_at
  FROM incidents WHERE hardware AND opened_at > now() - interval '30 days' GROUP BY node
UNION ALL
SELECT 'gpu', string_agg(DISTINCT node, ','), gpu_uuid, count(*), max(opened_at)
  FROM incidents WHERE hardware AND gpu_uuid IS NOT NULL AND opened_at > now() - interval '30 days' GROUP BY gpu_uuid;
