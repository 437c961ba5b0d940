//! The HTML pages: rendered on the server from the same views as the API, with inline CSS and a
//! few lines of plain JavaScript that append live verdicts from `/api/v1/live` (Server-Sent
//! Events). Nothing is fetched from elsewhere and nothing needs a build step. Every value from
//! outside is escaped ([`esc`]) or percent-encoded ([`enc`]); the script sets text, never HTML.

use std::fmt::Write as _;
use std::sync::Arc;

use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{Html, IntoResponse, Response};
use chrono::{DateTime, Utc};
use gpumedic_classifier::api::{Incident, IncidentDetail};
use uuid::Uuid;

use crate::api::{NodeDetailParams, unavailable};
use crate::fleet::{self, NodeParams, NodeQuery, NodeSummary};
use crate::store::{IncidentCursor, RecentAction, RecentVerdict};
use crate::view::{self, Console, FleetView, NodeView, NodesView, Remediator};

const STYLE: &str = r#"
*{box-sizing:border-box}body{margin:0;font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#1d2330;background:#f4f6f9}
header{background:#1d2330;color:#fff;padding:10px 24px;display:flex;gap:24px;align-items:center}
header a{color:#fff;text-decoration:none}header .brand{font-weight:700;font-size:16px}header nav a{margin-right:16px;opacity:.85}
main{padding:20px 24px;max-width:1400px}h1{font-size:22px;margin:0 0 16px}h2{font-size:16px;margin:24px 0 8px}
a{color:#1f5fbf}.cards{display:flex;flex-wrap:wrap;gap:16px}.card{background:#fff;border:1px solid #dde2ea;border-radius:6px;padding:14px 18px;min-width:200px}
.big{font-size:40px;font-weight:700}.muted{color:#667085}.ok{color:#137333}.bad{color:#b3261e}.warn{color:#a15c00}
table{border-collapse:collapse;background:#fff;border:1px solid #dde2ea;width:100%;margin-bottom:8px}
th,td{text-align:left;padding:6px 10px;border-bottom:1px solid #eef1f5;vertical-align:top}th{background:#f8f9fb;font-weight:600}
code{background:#eef1f5;padding:2px 5px;border-radius:4px;font-size:13px}
.pill{display:inline-block;padding:1px 8px;border-radius:10px;font-size:12px;background:#eef1f5}
.sev-critical,.state-quarantined,.state-failed,.state-draining{background:#fde7e6;color:#8c1d18}
.sev-warning,.state-drained,.state-remediating{background:#fff1d6;color:#7a4700}
.state-healthy,.state-remediated,.sev-info{background:#e3f4e8;color:#0d5223}
form.filters{display:flex;flex-wrap:wrap;gap:10px;align-items:end;margin-bottom:12px}form.filters label{display:flex;flex-direction:column;font-size:12px;color:#667085}
input,select{font:inherit;padding:4px 6px}ul.live{list-style:none;padding:0;margin:0}ul.live li{background:#fff;border:1px solid #dde2ea;border-radius:4px;padding:4px 8px;margin-bottom:4px}
dl.facts{display:grid;grid-template-columns:max-content auto;gap:4px 16px;background:#fff;border:1px solid #dde2ea;padding:12px 16px;border-radius:6px}dl.facts dt{color:#667085}dl.facts dd{margin:0}
"#;

const SCRIPT: &str = r#"
(function(){var feed=document.getElementById('live');if(!feed||!window.EventSource)return;
var node=feed.getAttribute('data-node');var es=new EventSource('/api/v1/live'+(node?'?node='+encodeURIComponent(node):''));
es.onopen=function(){feed.setAttribute('data-live','open');};es.onerror=function(){feed.setAttribute('data-live','retrying');};
es.addEventListener('verdict',function(m){var v=JSON.parse(m.data);var li=document.createElement('li');
li.className='live-verdict';li.setAttribute('data-verdict-id',v.verdict_id);li.setAttribute('data-node',v.node);
var s=document.createElement('span');s.className='pill sev-'+v.severity;s.textContent=v.recovery?'recovered':v.severity;li.appendChild(s);
var a=document.createElement('a');a.href='/incidents/'+v.incident_id;
a.textContent=' '+v.issued_at.replace('T',' ').slice(0,19)+' '+v.node+' '+v.rule_id+(v.recovery?'':' \u2192 '+v.action)+': '+v.reason;
li.appendChild(a);feed.insertBefore(li,feed.firstChild);var e=document.getElementById('live-empty');if(e)e.parentNode.removeChild(e);});
es.addEventListener('lagged',function(){location.reload();});})();
"#;

/// `text` escaped for HTML text and attribute values.
pub fn esc(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// `text` percent-encoded for a URL path segment or query value.
pub fn enc(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

fn query_string(pairs: &[(&str, String)]) -> String {
    pairs.iter().map(|(k, v)| format!("{k}={}", enc(v))).collect::<Vec<_>>().join("&")
}

fn time(t: &DateTime<Utc>) -> String {
    t.format("%Y-%m-%d %H:%M:%S UTC").to_string()
}

fn opt(v: &Option<String>) -> String {
    v.as_deref().map(esc).unwrap_or_else(|| "-".into())
}

/// A whole page around `body`.
pub fn layout(title: &str, body: &str) -> String {
    format!(
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
<title>{} · gpumedic</title><style>{STYLE}</style></head><body><header><a class=\"brand\" href=\"/\">gpumedic</a>\
<nav><a href=\"/\">Fleet</a><a href=\"/nodes\">Nodes</a></nav></header><main>{body}</main><script>{SCRIPT}</script></body></html>",
        esc(title)
    )
}

fn error_page(status: StatusCode, reason: &str) -> Response {
    let body = format!("<h1>{}</h1><p>{}</p>", status.as_u16(), esc(reason));
    (status, Html(layout(status.canonical_reason().unwrap_or("Error"), &body))).into_response()
}

fn view_error(e: &view::ViewError) -> Response {
    let (status, reason) = unavailable(e);
    error_page(status, &reason)
}

fn pill(class: &str, text: &str) -> String {
    format!("<span class=\"pill {class}-{}\">{}</span>", esc(text), esc(text))
}

fn node_link(name: &str) -> String {
    format!("<a href=\"/nodes/{}\">{}</a>", enc(name), esc(name))
}

fn live_feed(node: Option<&str>) -> String {
    let attr = node.map(|n| format!(" data-node=\"{}\"", esc(n))).unwrap_or_default();
    format!(
        "<h2>Live verdicts</h2><p id=\"live-empty\" class=\"muted\">Verdicts published from now on appear here without a reload.</p>\
<ul id=\"live\" class=\"live\"{attr}></ul>"
    )
}

/// `GET /`: the fleet page.
pub async fn fleet(State(c): State<Arc<Console>>) -> Response {
    match view::fleet_view(&c).await {
        Ok(v) => Html(layout("Fleet", &fleet_body(&v))).into_response(),
        Err(e) => view_error(&e),
    }
}

/// The fleet page's body.
pub fn fleet_body(v: &FleetView) -> String {
    let f = &v.fleet;
    let ratio = f.gpus.in_service_ratio * 100.0;
    let class = if ratio >= 99.0 {
        "ok"
    } else if ratio >= 95.0 {
        "warn"
    } else {
        "bad"
    };
    let mut b = String::from("<h1>Fleet</h1><div class=\"cards\">");
    let _ = write!(
        b,
        "<div class=\"card\" id=\"capacity\"><div class=\"muted\">GPU capacity in service</div>\
<div class=\"big {class}\" id=\"in-service-ratio\">{ratio:.1}%</div><div class=\"muted\">{} of {} GPUs on {} nodes</div></div>",
        f.gpus.in_service, f.gpus.total, f.nodes
    );
    let _ = write!(
        b,
        "<div class=\"card\"><div class=\"muted\">GPUs out of service</div><div class=\"big\" id=\"gpus-out\">{}</div>\
<div class=\"muted\">on {} cordoned or tainted nodes</div></div>",
        f.gpus.out_of_service,
        f.out_of_service.len()
    );
    b.push_str(&remediator_card(&v.remediator));
    b.push_str("</div><h2>Nodes by state</h2><table id=\"states\"><tr><th>state</th><th>nodes</th></tr>");
    for (state, n) in fleet::ordered_states(&f.nodes_by_state) {
        let _ = write!(
            b,
            "<tr><td><a href=\"/nodes?state={}\">{}</a></td><td>{n}</td></tr>",
            enc(&state),
            pill("state", &state)
        );
    }
    b.push_str("</table><h2>Out of service</h2>");
    if f.out_of_service.is_empty() {
        b.push_str("<p class=\"muted\">Every GPU node takes work.</p>");
    } else {
        b.push_str("<table id=\"out-of-service\"><tr><th>node</th><th>state</th><th>GPUs</th><th>cordoned</th><th>taints</th></tr>");
        for n in &f.out_of_service {
            let _ = write!(
                b,
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                node_link(&n.name),
                pill("state", &n.state),
                n.gpus,
                if n.cordoned { "yes" } else { "no" },
                taints(n)
            );
        }
        b.push_str("</table>");
    }
    let h = &v.last_hour;
    let verdicts: i64 = h.verdicts_by_severity.values().sum();
    let actions: i64 = h.actions_by_outcome.values().sum();
    let _ = write!(
        b,
        "<h2>Last hour</h2><div class=\"cards\"><div class=\"card\"><div class=\"muted\">verdicts</div><div class=\"big\">{verdicts}</div><div class=\"muted\">{}; {} recoveries</div></div>\
<div class=\"card\"><div class=\"muted\">actions</div><div class=\"big\">{actions}</div><div class=\"muted\">{}</div></div></div>",
        h.verdicts_by_severity.iter().map(|(k, n)| format!("{n} {}", esc(k))).collect::<Vec<_>>().join(", "),
        h.recoveries,
        h.actions_by_outcome.iter().map(|(k, n)| format!("{n} {}", esc(k))).collect::<Vec<_>>().join(", "),
    );
    b.push_str(&live_feed(None));
    b.push_str("<h2>Latest verdicts</h2>");
    b.push_str(&verdict_table(&h.recent_verdicts));
    b.push_str("<h2>Latest actions</h2>");
    b.push_str(&action_table(&h.recent_actions));
    b
}

fn remediator_card(r: &Remediator) -> String {
    let mut b = String::from("<div class=\"card\" id=\"remediator\"><div class=\"muted\">remediator</div>");
    if !r.found {
        b.push_str("<div>status object not found (no remediator has written it yet)</div>");
    }
    if r.breaker_open {
        let _ = write!(
            b,
            "<div class=\"bad\"><b>breaker open</b>: {} (since {})</div>",
            opt(&r.breaker_reason),
            opt(&r.breaker_tripped_at)
        );
    } else {
        b.push_str("<div class=\"ok\">breaker closed</div>");
    }
    if r.paused {
        let _ = write!(b, "<div class=\"warn\"><b>paused</b> by {}: {}</div>", opt(&r.paused_by), opt(&r.pause_reason));
    } else {
        b.push_str("<div class=\"ok\">not paused</div>");
    }
    for c in &r.commands {
        let _ = write!(b, "<div class=\"muted\">{}: <code>{}</code></div>", esc(&c.what), esc(&c.command));
    }
    b.push_str("</div>");
    b
}

fn taints(n: &NodeSummary) -> String {
    n.taints
        .iter()
        .map(|t| format!("<code>{}={}:{}</code>", esc(&t.key), opt(&t.value), esc(&t.effect)))
        .collect::<Vec<_>>()
        .join(" ")
}

fn verdict_table(rows: &[RecentVerdict]) -> String {
    if rows.is_empty() {
        return "<p class=\"muted\">None.</p>".into();
    }
    let mut b = String::from(
        "<table><tr><th>issued</th><th>node</th><th>rule</th><th>severity</th><th>action</th><th>reason</th></tr>",
    );
    for v in rows {
        let _ = write!(
            b,
            "<tr><td><a href=\"/incidents/{}\">{}</a></td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            v.incident_id,
            time(&v.issued_at),
            node_link(&v.node),
            esc(&v.rule_id),
            pill("sev", &v.severity),
            if v.recovery { "recovery".to_owned() } else { esc(&v.action) },
            esc(&v.reason)
        );
    }
    b.push_str("</table>");
    b
}

fn action_table(rows: &[RecentAction]) -> String {
    if rows.is_empty() {
        return "<p class=\"muted\">None.</p>".into();
    }
    let mut b = String::from("<table><tr><th>at</th><th>node</th><th>action</th><th>status</th><th>detail</th></tr>");
    for a in rows {
        let _ = write!(
            b,
            "<tr><td><a href=\"/incidents/{}\">{}</a></td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            a.incident_id,
            time(&a.at),
            node_link(&a.node),
            esc(&a.action),
            esc(&a.status),
            esc(&a.detail)
        );
    }
    b.push_str("</table>");
    b
}

/// `GET /nodes`: the node list.
pub async fn nodes(State(c): State<Arc<Console>>, params: Result<Query<NodeParams>, QueryRejection>) -> Response {
    let q = match params.map_err(|e| e.body_text()).and_then(|Query(p)| NodeQuery::parse(p)) {
        Ok(q) => q,
        Err(reason) => return error_page(StatusCode::BAD_REQUEST, &reason),
    };
    match view::nodes_view(&c, &q).await {
        Ok(v) => Html(layout("Nodes", &nodes_body(&v, &q))).into_response(),
        Err(e) => view_error(&e),
    }
}

fn select(name: &str, label: &str, options: &[String], current: &Option<String>) -> String {
    let mut b = format!("<label>{label}<select name=\"{name}\"><option value=\"\">any</option>");
    for o in options {
        let selected = if current.as_ref() == Some(o) { " selected" } else { "" };
        let _ = write!(b, "<option value=\"{}\"{selected}>{}</option>", esc(o), esc(o));
    }
    b.push_str("</select></label>");
    b
}

/// The node list's body.
pub fn nodes_body(v: &NodesView, q: &NodeQuery) -> String {
    let mut b = String::from("<h1>Nodes</h1><form class=\"filters\" method=\"get\" action=\"/nodes\">");
    let _ = write!(
        b,
        "<label>name<input name=\"q\" value=\"{}\" placeholder=\"search\"></label>",
        q.search.as_deref().map(esc).unwrap_or_default()
    );
    b.push_str(&select("state", "state", &v.choices.states, &q.state));
    b.push_str(&select("product", "GPU product", &v.choices.products, &q.product));
    b.push_str(&select("zone", "zone", &v.choices.zones, &q.zone));
    b.push_str(&select("rule", "open incident of rule", &v.choices.rules, &q.rule));
    let _ = write!(
        b,
        "<button type=\"submit\">Filter</button></form><p class=\"muted\" id=\"matched\">{} nodes match.</p>",
        v.matched
    );
    b.push_str("<table id=\"nodes\"><tr><th>node</th><th>state</th><th>cordoned</th><th>GPU product</th><th>zone</th><th>GPUs</th><th>open incidents</th></tr>");
    for row in &v.items {
        let n = &row.node;
        let open = &row.open_incidents;
        let incidents = if open.count == 0 {
            "-".to_owned()
        } else {
            format!(
                "{} {} ({})",
                open.count,
                open.worst.as_deref().map(|w| pill("sev", w)).unwrap_or_default(),
                open.rules.iter().map(|r| esc(r)).collect::<Vec<_>>().join(", ")
            )
        };
        let _ = write!(
            b,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{incidents}</td></tr>",
            node_link(&n.name),
            pill("state", &n.state),
            if n.cordoned { "yes" } else { "no" },
            opt(&n.product),
            opt(&n.zone),
            n.gpus
        );
    }
    b.push_str("</table>");
    if let Some(next) = &v.next_cursor {
        let mut pairs = q.filters();
        pairs.push(("limit", q.limit.to_string()));
        pairs.push(("cursor", next.clone()));
        let _ = write!(b, "<p><a id=\"next\" href=\"/nodes?{}\">Next page</a></p>", esc(&query_string(&pairs)));
    }
    b
}

/// `GET /nodes/{name}`: one node.
pub async fn node(
    State(c): State<Arc<Console>>,
    Path(name): Path<String>,
    params: Result<Query<NodeDetailParams>, QueryRejection>,
) -> Response {
    let cursor = match params {
        Ok(Query(p)) => p.cursor,
        Err(e) => return error_page(StatusCode::BAD_REQUEST, &e.body_text()),
    };
    if let Some(Err(reason)) = cursor.as_deref().map(IncidentCursor::decode) {
        return error_page(StatusCode::BAD_REQUEST, &reason);
    }
    match view::node_view(&c, &name, cursor).await {
        Ok(Some(v)) => Html(layout(&name, &node_body(&v))).into_response(),
        Ok(None) => error_page(StatusCode::NOT_FOUND, &format!("No GPU node {name} in the fleet.")),
        Err(e) => view_error(&e),
    }
}

fn incident_table(rows: &[Incident], id: &str) -> String {
    if rows.is_empty() {
        return "<p class=\"muted\">None.</p>".into();
    }
    let mut b = format!(
        "<table id=\"{id}\"><tr><th>opened</th><th>rule</th><th>severity</th><th>GPU</th><th>resolved</th><th>summary</th></tr>"
    );
    for i in rows {
        let _ = write!(
            b,
            "<tr class=\"incident\"><td><a href=\"/incidents/{}\">{}</a></td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            i.incident_id,
            time(&i.opened_at),
            esc(&i.rule_id),
            pill("sev", &i.severity),
            opt(&i.gpu),
            i.resolved_at.as_ref().map(time).unwrap_or_else(|| "<b>open</b>".into()),
            esc(&i.summary)
        );
    }
    b.push_str("</table>");
    b
}

/// The node page's body.
pub fn node_body(v: &NodeView) -> String {
    let n = &v.node;
    let mut b = format!("<h1>Node {}</h1><dl class=\"facts\">", esc(&n.name));
    let _ = write!(
        b,
        "<dt>state</dt><dd id=\"node-state\">{}</dd><dt>cordoned</dt><dd>{}</dd><dt>GPU product</dt><dd>{}</dd>\
<dt>zone</dt><dd>{}</dd><dt>GPUs</dt><dd>{}{}</dd><dt>gpumedic taints</dt><dd>{}</dd></dl>",
        pill("state", &n.state),
        if n.cordoned { "yes" } else { "no" },
        opt(&n.product),
        opt(&n.zone),
        n.gpus,
        if n.out_of_service { " (out of service)" } else { "" },
        if n.taints.is_empty() { "-".to_owned() } else { taints(n) }
    );
    if !n.conditions.is_empty() {
        b.push_str("<h2>Conditions</h2><table><tr><th>type</th><th>status</th><th>reason</th><th>message</th><th>since</th></tr>");
        for c in &n.conditions {
            let _ = write!(
                b,
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                esc(&c.type_),
                esc(&c.status),
                opt(&c.reason),
                opt(&c.message),
                opt(&c.last_transition)
            );
        }
        b.push_str("</table>");
    }
    b.push_str("<h2>GPUs</h2>");
    match &v.inventory {
        None => {
            b.push_str("<p class=\"muted\">No GPU inventory from this node's collector within the event retention.</p>")
        }
        Some(inv) => {
            let _ = write!(
                b,
                "<p class=\"muted\">Inventory of {}{}.</p><table id=\"gpus\"><tr><th>index</th><th>UUID</th><th>PCI bus id</th><th>serial</th><th>product</th></tr>",
                time(&inv.observed_at),
                inv.expected.map(|e| format!(", {e} expected")).unwrap_or_default()
            );
            for g in &inv.gpus {
                let _ = write!(
                    b,
                    "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                    g.index.map(|i| i.to_string()).unwrap_or_else(|| "-".into()),
                    opt(&g.uuid),
                    opt(&g.pci_bus_id),
                    opt(&g.serial),
                    opt(&g.product)
                );
            }
            b.push_str("</table>");
        }
    }
    b.push_str("<h2>Open incidents</h2>");
    b.push_str(&incident_table(&v.open_incidents, "open-incidents"));
    b.push_str(&live_feed(Some(&n.name)));
    b.push_str("<h2>Incidents</h2>");
    b.push_str(&incident_table(&v.incidents.items, "incidents"));
    if let Some(next) = &v.incidents.next_cursor {
        let _ = write!(b, "<p><a href=\"/nodes/{}?cursor={}\">Older incidents</a></p>", enc(&n.name), enc(next));
    }
    b.push_str("<h2>Actions</h2>");
    b.push_str(&action_table(&v.actions));
    b.push_str("<h2>Kubernetes Events</h2>");
    if let Some(e) = &v.events_error {
        let _ = write!(b, "<p class=\"warn\">The Events could not be read: {}.</p>", esc(e));
    } else if v.events.is_empty() {
        b.push_str("<p class=\"muted\">None.</p>");
    } else {
        b.push_str("<table id=\"events\"><tr><th>last seen</th><th>type</th><th>reason</th><th>message</th><th>from</th><th>count</th></tr>");
        for e in &v.events {
            let _ = write!(
                b,
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                opt(&e.at),
                opt(&e.type_),
                opt(&e.reason),
                opt(&e.message),
                opt(&e.source),
                e.count.map(|c| c.to_string()).unwrap_or_else(|| "-".into())
            );
        }
        b.push_str("</table>");
    }
    b
}

/// `GET /incidents/{id}`: one incident's story.
pub async fn incident(State(c): State<Arc<Console>>, Path(id): Path<String>) -> Response {
    let Ok(uuid) = id.parse::<Uuid>() else {
        return error_page(StatusCode::BAD_REQUEST, &format!("'{id}' is not an incident id (a UUID)."));
    };
    match view::incident_view(&c, uuid).await {
        Ok(Some(d)) => {
            Html(layout(&format!("Incident {uuid}"), &incident_body(&d, c.trace_url.as_deref()))).into_response()
        }
        Ok(None) => error_page(StatusCode::NOT_FOUND, &format!("No incident {uuid}.")),
        Err(e) => view_error(&e),
    }
}

/// One line of an incident's story.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct StoryLine {
    /// When.
    pub at: DateTime<Utc>,
    /// `evidence`, `verdict`, `action` or `recovery`.
    pub what: &'static str,
    /// The headline.
    pub headline: String,
    /// The detail.
    pub detail: String,
    /// A verdict's trace id, when its record carried one.
    pub trace_id: Option<String>,
}

/// The story of an incident in time order: evidence, verdicts, actions and the recovery, as
/// `gpumedic incidents --id` tells it.
pub fn story(d: &IncidentDetail) -> Vec<StoryLine> {
    let mut lines = Vec::new();
    for e in &d.events {
        let xid = e.xid.map(|x| format!(" Xid {x}")).unwrap_or_default();
        lines.push(StoryLine {
            at: e.observed_at,
            what: "evidence",
            headline: format!("{} {}{xid}", e.source, e.kind),
            detail: format!(
                "event {}{}{}",
                e.event_id,
                if e.healthy { ", healthy" } else { "" },
                if e.synthetic { ", injected" } else { "" }
            ),
            trace_id: None,
        });
    }
    for v in &d.verdicts {
        lines.push(StoryLine {
            at: v.issued_at,
            what: if v.recovery { "recovery" } else { "verdict" },
            headline: if v.recovery { "recovered".into() } else { format!("{} {}", v.severity, v.action) },
            detail: v.reason.clone(),
            trace_id: v.trace_id.clone(),
        });
    }
    for a in &d.actions {
        lines.push(StoryLine {
            at: a.at,
            what: "action",
            headline: format!("{} {}", a.action, a.status),
            detail: a.detail.clone(),
            trace_id: None,
        });
    }
    lines.sort();
    lines
}

/// The incident page's body; with `trace_url` (`{trace_id}` in it), each verdict links to its
/// trace.
pub fn incident_body(d: &IncidentDetail, trace_url: Option<&str>) -> String {
    let i = &d.incident;
    let mut b = format!("<h1>Incident {}</h1><dl class=\"facts\">", i.incident_id);
    let _ = write!(
        b,
        "<dt>node</dt><dd>{}</dd><dt>GPU</dt><dd>{}</dd><dt>rule</dt><dd>{}</dd><dt>severity</dt><dd>{}</dd>\
<dt>opened</dt><dd>{}</dd><dt>resolved</dt><dd id=\"resolved\">{}</dd><dt>summary</dt><dd>{}</dd></dl>",
        node_link(&i.node),
        opt(&i.gpu),
        esc(&i.rule_id),
        pill("sev", &i.severity),
        time(&i.opened_at),
        i.resolved_at.as_ref().map(time).unwrap_or_else(|| "open".into()),
        esc(&i.summary)
    );
    b.push_str("<h2>Story</h2><table id=\"story\"><tr><th>time</th><th>what</th><th></th><th>detail</th></tr>");
    for l in story(d) {
        // Trace ids are hex from our own records; escaped all the same.
        let trace = match (trace_url, &l.trace_id) {
            (Some(url), Some(id)) => {
                format!(" <a class=\"trace\" href=\"{}\">trace</a>", esc(&url.replace("{trace_id}", id)))
            }
            _ => String::new(),
        };
        let _ = write!(
            b,
            "<tr class=\"story-{}\"><td>{}</td><td>{}</td><td>{}</td><td>{}{trace}</td></tr>",
            l.what,
            time(&l.at),
            l.what,
            esc(&l.headline),
            esc(&l.detail)
        );
    }
    b.push_str("</table>");
    if !d.peers.is_empty() {
        b.push_str("<h2>NVLink peers</h2><table><tr><th>at</th><th>node</th><th>GPU</th><th>event</th></tr>");
        for p in &d.peers {
            let _ = write!(
                b,
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                time(&p.at),
                node_link(&p.node),
                opt(&p.gpu),
                p.event_id
            );
        }
        b.push_str("</table>");
    }
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outside_text_is_escaped_and_encoded() {
        assert_eq!(esc("<a href=\"x\">&'"), "&lt;a href=&quot;x&quot;&gt;&amp;&#39;");
        assert_eq!(enc("gpu node/1?&"), "gpu%20node%2F1%3F%26");
        assert_eq!(enc("demo-1.example"), "demo-1.example");
    }

    #[test]
    fn the_story_is_in_time_order_with_the_recovery_last() {
        use gpumedic_classifier::api::{ActionRow, EventRow, VerdictRow};
        let t = |s: i64| DateTime::from_timestamp(1_764_000_000 + s, 0).unwrap();
        let id = Uuid::new_v4();
        let d = IncidentDetail {
            incident: Incident {
                incident_id: id,
                node: "n".into(),
                gpu: None,
                rule_id: "xid-79".into(),
                severity: "critical".into(),
                opened_at: t(1),
                resolved_at: Some(t(30)),
                summary: "s".into(),
            },
            verdicts: vec![
                VerdictRow {
                    verdict_id: id,
                    action: "cordon".into(),
                    severity: "critical".into(),
                    reason: "r".into(),
                    recovery: false,
                    evidence: vec![],
                    issued_at: t(1),
                    trace_id: Some("4bf92f3577b34da6a3ce929d0e0e4736".into()),
                },
                VerdictRow {
                    verdict_id: id,
                    action: "none".into(),
                    severity: "info".into(),
                    reason: "back".into(),
                    recovery: true,
                    evidence: vec![],
                    issued_at: t(30),
                    trace_id: None,
                },
            ],
            events: vec![EventRow {
                event_id: id,
                observed_at: t(0),
                source: "kmsg".into(),
                kind: "xid".into(),
                xid: Some(79),
                healthy: false,
                synthetic: true,
            }],
            actions: vec![ActionRow {
                verdict_id: id,
                action: "cordon".into(),
                status: "succeeded".into(),
                detail: "d".into(),
                at: t(2),
            }],
            peers: vec![],
        };
        let whats: Vec<&str> = story(&d).iter().map(|l| l.what).collect();
        assert_eq!(whats, ["evidence", "verdict", "action", "recovery"]);
        let html = incident_body(&d, None);
        assert!(html.contains("Xid 79") && html.contains("story-recovery"), "{html}");
        assert!(!html.contains("class=\"trace\""), "no links without --trace-url: {html}");
        let html = incident_body(&d, Some("http://jaeger:16686/trace/{trace_id}"));
        assert_eq!(
            html.matches("<a class=\"trace\" href=\"http://jaeger:16686/trace/4bf92f3577b34da6a3ce929d0e0e4736\">")
                .count(),
            1,
            "the verdict with a trace id links to it, the recovery without one does not: {html}"
        );
    }
}
