//! The compliance report: one self-contained HTML file (inline CSS and SVG, no script, no
//! network) over a verified audit session and a time window.
//!
//! Sections, in order: the audit log's own verification; the exposure summary (and every
//! affected response); prevented exposures and integrity violations; requests and tokens per
//! tenant over time; transfer outcomes; the request latency distribution; nodes that ran the
//! incident reproduction on purpose. Every figure comes from SQL over the `all_<table>` views
//! (sealed ∪ live, see [`crate::prepare_forensics`]); the live segment, which no digest covers
//! yet, is called out when it contributes.
//!
//! Charts are drawn here, as SVG, by a few small functions: bounded inputs (at most
//! [`MAX_SERIES`] tenants drawn individually, the rest folded into "other"; at most
//! [`BUCKETS`] time buckets), escaped text, no external assets.

use std::fmt::Write as _;

use datafusion::arrow::array::{Array, AsArray};
use datafusion::arrow::datatypes::{Int64Type, UInt64Type};
use datafusion::prelude::SessionContext;

use crate::forensics::{self, Exposure};
use crate::{QueryError, VerifiedSession};

/// Tenants drawn as their own series; the rest are summed as "other".
pub const MAX_SERIES: usize = 8;
/// Time buckets of the over-time charts.
pub const BUCKETS: usize = 24;

const PALETTE: [&str; MAX_SERIES + 1] = [
    "#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#9c755f",
    "#bab0ac",
];

/// What the report covers.
#[derive(Clone, Debug)]
pub struct ReportScope {
    /// The audit root as the user named it (shown, not opened).
    pub root: String,
    pub from_ns: Option<i64>,
    pub to_ns: Option<i64>,
    /// When the report was generated (Unix ns).
    pub generated_ns: i64,
}

fn esc(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&#39;"),
            c => o.push(c),
        }
    }
    o
}

/// `YYYY-MM-DD HH:MM:SS UTC` of Unix ns.
fn utc(ns: i64) -> String {
    let secs = ns.div_euclid(1_000_000_000);
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02} UTC",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

async fn rows(ctx: &SessionContext, sql: &str) -> Result<Vec<Vec<Cell>>, QueryError> {
    let batches = ctx.sql(sql).await?.collect().await?;
    let mut out = Vec::new();
    for b in &batches {
        for i in 0..b.num_rows() {
            out.push(
                b.columns()
                    .iter()
                    .map(|c| Cell::of(c.as_ref(), i))
                    .collect(),
            );
        }
    }
    Ok(out)
}

/// One value of a result row (the report needs only these shapes).
#[derive(Clone, Debug, PartialEq)]
enum Cell {
    I(i64),
    S(String),
    Null,
}

impl Cell {
    fn of(a: &dyn Array, i: usize) -> Self {
        use datafusion::arrow::datatypes::DataType as T;
        if a.is_null(i) {
            return Cell::Null;
        }
        match a.data_type() {
            T::Int64 => Cell::I(a.as_primitive::<Int64Type>().value(i)),
            T::UInt64 => Cell::I(a.as_primitive::<UInt64Type>().value(i) as i64),
            T::Int32 | T::UInt32 | T::Int16 | T::UInt16 | T::Int8 | T::UInt8 => {
                let c = datafusion::arrow::compute::cast(&a.slice(i, 1), &T::Int64)
                    .ok()
                    .map(|c| c.as_primitive::<Int64Type>().value(0));
                c.map_or(Cell::Null, Cell::I)
            }
            T::Utf8 => Cell::S(a.as_string::<i32>().value(i).to_owned()),
            T::LargeUtf8 => Cell::S(a.as_string::<i64>().value(i).to_owned()),
            T::Utf8View => Cell::S(a.as_string_view().value(i).to_owned()),
            _ => Cell::Null,
        }
    }
    fn i(&self) -> i64 {
        match self {
            Cell::I(v) => *v,
            _ => 0,
        }
    }
    fn s(&self) -> String {
        match self {
            Cell::S(v) => v.clone(),
            Cell::I(v) => v.to_string(),
            Cell::Null => String::new(),
        }
    }
}

fn window(col: &str, s: &ReportScope) -> String {
    format!(
        "{col} >= {} AND {col} < {}",
        s.from_ns.unwrap_or(i64::MIN),
        s.to_ns.unwrap_or(i64::MAX)
    )
}

/// Build the report. `vs` must have been prepared with [`crate::prepare_forensics`].
pub async fn render(vs: &VerifiedSession, scope: &ReportScope) -> Result<String, QueryError> {
    let ctx = &vs.ctx;
    let w = window("wall_ns", scope);
    let exposure = forensics::exposure(ctx, scope.from_ns, scope.to_ns).await?;

    // Time axis: the window's requests.
    let span = rows(
        ctx,
        &format!("SELECT MIN(wall_ns), MAX(wall_ns), COUNT(*) FROM all_requests WHERE {w}"),
    )
    .await?;
    let (t0, t1) = span.first().map(|r| (r[0].i(), r[1].i())).unwrap_or((0, 0));
    let bucket_ns = ((t1 - t0) / BUCKETS as i64 + 1).max(1);

    // Requests are counted on the nodes clients talk to: a decode node's rows are the same
    // requests again (imported from a prefill node), so only its output tokens count.
    let front = "LEFT JOIN (SELECT DISTINCT node_id AS dnode FROM all_node_events
                           WHERE event = 'start' AND detail LIKE 'role=decode%') d
                 ON r.node_id = d.dnode";
    // Tenants ranked by requests; the first MAX_SERIES drawn individually.
    let per_tenant = rows(
        ctx,
        &format!(
            "SELECT tenant,
                    SUM(CASE WHEN d.dnode IS NULL AND event = 'admitted' THEN 1 ELSE 0 END) AS admitted,
                    SUM(CASE WHEN d.dnode IS NULL AND event = 'rejected' THEN 1 ELSE 0 END),
                    SUM(CASE WHEN d.dnode IS NULL AND event = 'finished' THEN 1 ELSE 0 END),
                    SUM(CASE WHEN d.dnode IS NULL AND event IN ('aborted', 'failed') THEN 1 ELSE 0 END),
                    SUM(CASE WHEN d.dnode IS NULL AND event = 'finished' THEN prompt_tokens ELSE 0 END),
                    SUM(CASE WHEN event = 'finished' THEN output_tokens ELSE 0 END)
             FROM all_requests r {front} WHERE {w} GROUP BY tenant
             ORDER BY admitted DESC, tenant"
        ),
    )
    .await?;
    let series: Vec<String> = per_tenant
        .iter()
        .take(MAX_SERIES)
        .map(|r| r[0].s())
        .collect();
    let series_of = |t: &str| series.iter().position(|s| s == t).unwrap_or(MAX_SERIES);
    let over_time = rows(
        ctx,
        &format!(
            "SELECT tenant, CAST((wall_ns - {t0}) / {bucket_ns} AS BIGINT) AS b,
                    SUM(CASE WHEN d.dnode IS NULL AND event = 'admitted' THEN 1 ELSE 0 END),
                    SUM(CASE WHEN event = 'finished' THEN output_tokens ELSE 0 END
                      + CASE WHEN d.dnode IS NULL AND event = 'finished' THEN prompt_tokens ELSE 0 END)
             FROM all_requests r {front} WHERE {w} GROUP BY tenant, b"
        ),
    )
    .await?;
    let mut req_grid = vec![vec![0f64; MAX_SERIES + 1]; BUCKETS];
    let mut tok_grid = vec![vec![0f64; MAX_SERIES + 1]; BUCKETS];
    for r in &over_time {
        let b = (r[1].i().max(0) as usize).min(BUCKETS - 1);
        let s = series_of(&r[0].s());
        req_grid[b][s] += r[2].i() as f64;
        tok_grid[b][s] += r[3].i() as f64;
    }
    let mut names: Vec<String> = series.clone();
    if per_tenant.len() > MAX_SERIES {
        names.push(format!("other ({})", per_tenant.len() - MAX_SERIES));
    }

    let violations = rows(
        ctx,
        &format!(
            "SELECT kind, COUNT(*) FROM all_integrity_violations WHERE {w}
             GROUP BY kind ORDER BY 2 DESC, kind"
        ),
    )
    .await?;
    let transfers = rows(
        ctx,
        &format!(
            "SELECT outcome, COUNT(*), SUM(bytes) FROM all_transfers WHERE {w}
             GROUP BY outcome ORDER BY 2 DESC, outcome"
        ),
    )
    .await?;
    // Latency: admission to the end, per request, on the node that generates (a colocated or
    // decode node; a prefill node's requests end at the hand-off).
    let latency = rows(
        ctx,
        &format!(
            "SELECT CAST((e.wall_ns - a.wall_ns) / 1000000 AS BIGINT)
             FROM all_requests a JOIN all_requests e
               ON a.node_id = e.node_id AND a.request_id = e.request_id
             LEFT JOIN (SELECT DISTINCT node_id AS pnode FROM all_node_events
                        WHERE event = 'start' AND detail LIKE 'role=prefill%') p
               ON a.node_id = p.pnode
             WHERE p.pnode IS NULL AND a.event = 'admitted'
               AND e.event IN ('finished', 'aborted', 'failed') AND {}",
            window("a.wall_ns", scope)
        ),
    )
    .await?;
    let mut latency_ms: Vec<i64> = latency.iter().map(|r| r[0].i().max(0)).collect();
    latency_ms.sort_unstable();
    let unsafe_nodes = rows(
        ctx,
        "SELECT node_id, MIN(wall_ns), MAX(detail) FROM all_node_events
         WHERE event = 'unsafe_reproduction' GROUP BY node_id ORDER BY node_id",
    )
    .await?;
    let live_rows = rows(
        ctx,
        "SELECT (SELECT COUNT(*) FROM requests_live) + (SELECT COUNT(*) FROM page_events_live)
              + (SELECT COUNT(*) FROM page_reads_live) + (SELECT COUNT(*) FROM transfers_live)
              + (SELECT COUNT(*) FROM integrity_violations_live)",
    )
    .await?
    .first()
    .map_or(0, |r| r[0].i());

    let mut h = String::with_capacity(64 << 10);
    head(&mut h, scope);
    if !unsafe_nodes.is_empty() {
        let _ = write!(
            h,
            "<div class=\"banner\"><b>Incident reproduction.</b> These nodes ran with \
             protections switched off on purpose (<code>--unsafe-reproduction</code>): {}</div>",
            unsafe_nodes
                .iter()
                .map(|r| format!(
                    "node {} ({}) since {}",
                    r[0].i(),
                    esc(&r[2].s()),
                    utc(r[1].i())
                ))
                .collect::<Vec<_>>()
                .join("; ")
        );
    }
    verification(&mut h, vs, live_rows);
    exposure_section(&mut h, &exposure);
    let _ = write!(h, "<h2>Integrity</h2><div class=\"row\">");
    let prevented = exposure.prevented as f64;
    let v: Vec<(String, f64)> = violations
        .iter()
        .map(|r| (r[0].s(), r[1].i() as f64))
        .collect();
    let _ = write!(
        h,
        "<div class=\"card\"><h3>Integrity violations by kind</h3>{}\
         <p class=\"note\">Each is a read or write the page-tag check refused; {} of them were \
         reads of another request's data — <b>prevented exposures</b>.</p></div>",
        if v.is_empty() {
            "<p class=\"note\">No integrity violations in this window.</p>".to_owned()
        } else {
            hbars(&v, "#e15759")
        },
        prevented
    );
    let t: Vec<(String, f64)> = transfers
        .iter()
        .map(|r| (r[0].s(), r[1].i() as f64))
        .collect();
    let tbytes: i64 = transfers.iter().map(|r| r[2].i()).sum();
    let _ = write!(
        h,
        "<div class=\"card\"><h3>KV transfer outcomes</h3>{}<p class=\"note\">{} page \
         transfers, {:.1} MiB, as recorded by both nodes (prefill: completed/failed; decode: \
         verified/refused).</p></div></div>",
        if t.is_empty() {
            "<p class=\"note\">No transfers in this window (colocated serving).</p>".to_owned()
        } else {
            hbars(&t, "#4e79a7")
        },
        t.iter().map(|x| x.1).sum::<f64>(),
        tbytes as f64 / (1 << 20) as f64
    );

    let _ = write!(
        h,
        "<h2>Requests and tokens per tenant</h2><div class=\"row\"><div class=\"card wide\">\
         <h3>Requests admitted over time</h3>{}{}</div><div class=\"card wide\">\
         <h3>Tokens served over time (prompt + output)</h3>{}</div></div>",
        stacked(&req_grid, &names, t0, bucket_ns),
        legend(&names),
        stacked(&tok_grid, &names, t0, bucket_ns)
    );
    tenant_table(&mut h, &per_tenant);
    latency_section(&mut h, &latency_ms);
    let _ = write!(
        h,
        "<footer>Generated by <code>custody report</code> from the audit log alone. Every figure \
         is SQL over the verified Parquet files (see <code>docs/forensics.md</code>); rerun any \
         of it with <code>custody query</code>.</footer></body></html>"
    );
    Ok(h)
}

/// The exposure answer in one line, for terminals.
pub fn one_line(e: &Exposure) -> String {
    let join = |v: std::collections::BTreeSet<&str>| v.into_iter().collect::<Vec<_>>().join(", ");
    match e.first_last_wall_ns() {
        None => format!(
            "0 affected responses; {} reads of another request's data prevented by the tag check",
            e.prevented
        ),
        Some((first, last)) => format!(
            "{} affected response(s): data of {} tenant(s) [{}] reached {} tenant(s) [{}]; at most \
             {} foreign slots in one reply; {} prevented; {} .. {}",
            e.affected_responses(),
            e.source_tenants().len(),
            join(e.source_tenants()),
            e.recipient_tenants().len(),
            join(e.recipient_tenants()),
            e.max_foreign_slots(),
            e.prevented,
            utc(first),
            utc(last)
        ),
    }
}

fn head(h: &mut String, s: &ReportScope) {
    let win = match (s.from_ns, s.to_ns) {
        (None, None) => "all time".to_owned(),
        (f, t) => format!(
            "{} — {}",
            f.map_or("beginning".into(), utc),
            t.map_or("now".into(), utc)
        ),
    };
    let _ = write!(
        h,
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">\
         <title>Custody compliance report</title><style>{CSS}</style></head><body>\
         <header><h1>Custody compliance report</h1><p>Audit root <code>{}</code> · window {} · \
         generated {}</p></header>",
        esc(&s.root),
        esc(&win),
        utc(s.generated_ns)
    );
}

const CSS: &str = "
body{font:15px/1.45 -apple-system,'Segoe UI',Roboto,'DejaVu Sans',sans-serif;color:#1f2328;
 background:#f6f7f9;margin:0;padding:0 32px 32px}
header{padding:24px 0 8px;border-bottom:3px solid #4e79a7;margin-bottom:16px}
h1{margin:0 0 4px;font-size:26px}h2{margin:28px 0 10px;font-size:20px}
h3{margin:0 0 10px;font-size:15px;color:#444}
.row{display:flex;flex-wrap:wrap;gap:16px}
.card{background:#fff;border:1px solid #dde1e6;border-radius:8px;padding:16px;flex:1 1 380px}
.card.wide{flex:1 1 560px}
.kpis{display:flex;flex-wrap:wrap;gap:12px}
.kpi{background:#fff;border:1px solid #dde1e6;border-radius:8px;padding:12px 16px;min-width:150px}
.kpi b{display:block;font-size:26px}.kpi span{color:#555;font-size:13px}
.kpi.bad b{color:#c62828}.kpi.good b{color:#2e7d32}
.banner{background:#fff4e5;border:1px solid #f0a23a;border-radius:8px;padding:12px 16px;margin:12px 0}
.ok{color:#2e7d32;font-weight:600}.fail{color:#c62828;font-weight:600}
table{border-collapse:collapse;width:100%;background:#fff;font-size:13px}
th,td{border-bottom:1px solid #e5e7eb;padding:6px 8px;text-align:left}
th{background:#f0f2f5}td.n{text-align:right;font-variant-numeric:tabular-nums}
.note{color:#555;font-size:13px}.legend span{display:inline-block;margin-right:14px;font-size:13px}
.legend i{display:inline-block;width:11px;height:11px;margin-right:5px;border-radius:2px}
footer{margin-top:32px;color:#666;font-size:12px}code{font-size:12px}
svg text{font:11px sans-serif;fill:#444}";

fn verification(h: &mut String, vs: &VerifiedSession, live_rows: i64) {
    let r = &vs.report;
    let _ = write!(
        h,
        "<h2>The audit log's own verification</h2><div class=\"kpis\">\
         <div class=\"kpi {}\"><b>{}</b><span>chain verdict</span></div>\
         <div class=\"kpi\"><b>{}</b><span>signed digests verified</span></div>\
         <div class=\"kpi\"><b>{}</b><span>sealed files verified (the only ones read)</span></div>\
         <div class=\"kpi {}\"><b>{}</b><span>problems (excluded from every figure)</span></div>\
         <div class=\"kpi\"><b>{}</b><span>rows from the unsealed live segment</span></div></div>",
        if r.ok() { "good" } else { "bad" },
        if r.ok() { "valid" } else { "PROBLEMS" },
        r.valid_digests,
        r.valid_files,
        if r.problems.is_empty() { "good" } else { "bad" },
        r.problems.len(),
        live_rows
    );
    if !r.problems.is_empty() {
        let _ = write!(h, "<table><tr><th>Problem</th></tr>");
        for p in r.problems.iter().take(200) {
            let _ = write!(h, "<tr><td>{}</td></tr>", esc(&p.to_string()));
        }
        let _ = write!(h, "</table>");
    }
    if live_rows > 0 {
        let _ = write!(
            h,
            "<p class=\"note\">The live segment is recoverable but not yet covered by a signed \
             digest; its rows are included and counted above.</p>"
        );
    }
}

fn exposure_section(h: &mut String, e: &Exposure) {
    let n = e.affected_responses();
    let (first, last) = e
        .first_last_wall_ns()
        .map_or(("—".to_owned(), "—".to_owned()), |(a, b)| {
            (utc(a), utc(b))
        });
    let _ = write!(
        h,
        "<h2>Exposure: who could have seen whose data</h2><div class=\"kpis\">\
         <div class=\"kpi {c}\"><b>{n}</b><span>affected responses</span></div>\
         <div class=\"kpi {c}\"><b>{}</b><span>tenants whose data was exposed</span></div>\
         <div class=\"kpi {c}\"><b>{}</b><span>tenants who received it</span></div>\
         <div class=\"kpi {c}\"><b>{}</b><span>most foreign slots in one reply</span></div>\
         <div class=\"kpi good\"><b>{}</b><span>prevented by the tag check</span></div></div>\
         <p class=\"note\">First {first} · last {last}. A response is affected when it attended \
         a slot whose latest earlier write was for another tenant (definition in \
         <code>docs/forensics.md</code>).</p>",
        e.source_tenants().len(),
        e.recipient_tenants().len(),
        e.max_foreign_slots(),
        e.prevented,
        c = if n == 0 { "good" } else { "bad" },
    );
    if n > 0 {
        let _ = write!(
            h,
            "<table><tr><th>node</th><th>request</th><th>recipient tenant</th>\
             <th>source tenant(s): foreign slots</th><th class=\"n\">foreign slots</th>\
             <th>time</th><th>tag check</th></tr>"
        );
        for a in e.affected.iter().take(500) {
            let _ = write!(
                h,
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td class=\"n\">{}</td>\
                 <td>{}</td><td>{}</td></tr>",
                a.node,
                a.request,
                esc(&a.recipient_tenant),
                esc(&a
                    .sources
                    .iter()
                    .map(|(t, s)| format!("{t}: {s}"))
                    .collect::<Vec<_>>()
                    .join(", ")),
                a.foreign_slots,
                utc(a.first_wall_ns),
                if a.unchecked { "off (unsafe)" } else { "on" }
            );
        }
        let _ = write!(h, "</table>");
        if n > 500 {
            let _ = write!(
                h,
                "<p class=\"note\">{} more: <code>custody forensics exposure</code> lists all.</p>",
                n - 500
            );
        }
    }
}

fn tenant_table(h: &mut String, per_tenant: &[Vec<Cell>]) {
    let _ = write!(
        h,
        "<h3 style=\"margin-top:16px\">Per tenant</h3><table><tr><th>tenant</th>\
         <th class=\"n\">admitted</th><th class=\"n\">rejected</th><th class=\"n\">finished</th>\
         <th class=\"n\">aborted / failed</th><th class=\"n\">prompt tokens</th>\
         <th class=\"n\">output tokens</th></tr>"
    );
    for r in per_tenant.iter().take(200) {
        let _ = write!(h, "<tr><td>{}</td>", esc(&r[0].s()));
        for c in &r[1..] {
            let _ = write!(h, "<td class=\"n\">{}</td>", c.i());
        }
        let _ = write!(h, "</tr>");
    }
    let _ = write!(h, "</table>");
}

fn latency_section(h: &mut String, ms: &[i64]) {
    let _ = write!(
        h,
        "<h2>Request latency (admission to end)</h2><div class=\"row\">"
    );
    if ms.is_empty() {
        let _ = write!(
            h,
            "<div class=\"card\"><p class=\"note\">No completed requests.</p></div></div>"
        );
        return;
    }
    let q = |p: f64| ms[((ms.len() - 1) as f64 * p).round() as usize];
    // Log-spaced buckets from 1 ms: [0,1), [1,2), [2,4), … up to the maximum.
    let max = *ms.last().unwrap_or(&0);
    let n_buckets = (64 - (max.max(1) as u64).leading_zeros()) as usize + 1;
    let mut counts = vec![0f64; n_buckets];
    for &v in ms {
        let b = if v <= 0 {
            0
        } else {
            (64 - (v as u64).leading_zeros()) as usize
        };
        counts[b.min(n_buckets - 1)] += 1.0;
    }
    let labels: Vec<String> = (0..n_buckets)
        .map(|b| {
            if b == 0 {
                "<1 ms".into()
            } else {
                fmt_ms(1i64 << (b - 1))
            }
        })
        .collect();
    let _ = write!(
        h,
        "<div class=\"card wide\"><h3>Distribution ({} requests, on the generating node; buckets double)</h3>{}</div>\
         <div class=\"card\"><div class=\"kpis\">\
         <div class=\"kpi\"><b>{}</b><span>p50</span></div>\
         <div class=\"kpi\"><b>{}</b><span>p90</span></div>\
         <div class=\"kpi\"><b>{}</b><span>p99</span></div>\
         <div class=\"kpi\"><b>{}</b><span>max</span></div></div></div></div>",
        ms.len(),
        vbars(&counts, &labels, "#59a14f"),
        fmt_ms(q(0.5)),
        fmt_ms(q(0.9)),
        fmt_ms(q(0.99)),
        fmt_ms(max)
    );
}

fn fmt_ms(ms: i64) -> String {
    if ms >= 10_000 {
        format!("{:.0} s", ms as f64 / 1000.0)
    } else if ms >= 1000 {
        format!("{:.1} s", ms as f64 / 1000.0)
    } else {
        format!("{ms} ms")
    }
}

fn fmt_n(v: f64) -> String {
    if v >= 1e6 {
        format!("{:.1}M", v / 1e6)
    } else if v >= 1e4 {
        format!("{:.0}k", v / 1e3)
    } else if v >= 1e3 {
        format!("{:.1}k", v / 1e3)
    } else {
        format!("{v:.0}")
    }
}

fn legend(names: &[String]) -> String {
    let mut s = String::from("<div class=\"legend\">");
    for (i, n) in names.iter().enumerate() {
        let _ = write!(
            s,
            "<span><i style=\"background:{}\"></i>{}</span>",
            PALETTE[i.min(MAX_SERIES)],
            esc(n)
        );
    }
    s.push_str("</div>");
    s
}

/// Stacked columns: `grid[bucket][series]`.
fn stacked(grid: &[Vec<f64>], names: &[String], t0: i64, bucket_ns: i64) -> String {
    let (w, hgt, left, bottom) = (560.0, 220.0, 44.0, 26.0);
    let total: Vec<f64> = grid.iter().map(|b| b.iter().sum()).collect();
    let max = nice_top(total.iter().copied().fold(0.0, f64::max));
    let bw = (w - left) / grid.len().max(1) as f64;
    let mut s = format!(
        "<svg viewBox=\"0 0 {w} {hgt}\" width=\"100%\" role=\"img\" \
         aria-label=\"stacked columns\">"
    );
    axis_y(&mut s, left, w, hgt - bottom, max);
    for (b, col) in grid.iter().enumerate() {
        let mut y = hgt - bottom;
        for (i, v) in col.iter().enumerate().take(names.len().max(1)) {
            if *v <= 0.0 {
                continue;
            }
            let bh = v / max * (hgt - bottom - 10.0);
            y -= bh;
            let _ = write!(
                s,
                "<rect x=\"{:.1}\" y=\"{y:.1}\" width=\"{:.1}\" height=\"{bh:.1}\" fill=\"{}\">\
                 <title>{}: {}</title></rect>",
                left + b as f64 * bw + 1.0,
                (bw - 2.0).max(1.0),
                PALETTE[i.min(MAX_SERIES)],
                esc(names.get(i).map_or("", |n| n.as_str())),
                fmt_n(*v)
            );
        }
    }
    let last = grid.len().saturating_sub(1);
    for (b, anchor, x) in [
        (0, "start", left),
        (
            grid.len() / 2,
            "middle",
            left + (grid.len() / 2) as f64 * bw + bw / 2.0,
        ),
        (last, "end", w),
    ] {
        let label = utc(t0 + b as i64 * bucket_ns);
        let _ = write!(
            s,
            "<text x=\"{x:.1}\" y=\"{:.1}\" text-anchor=\"{anchor}\">{}</text>",
            hgt - 8.0,
            esc(&label[11..19])
        );
    }
    s.push_str("</svg>");
    s
}

/// A "nice" axis top ≥ `max` (1, 2 or 5 × 10^k, times the tick count) so ticks are round.
fn nice_top(max: f64) -> f64 {
    let raw = (max / 4.0).max(0.25);
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag);
    // Whole-number ticks for counts.
    let step = if step < 1.0 { 1.0 } else { step };
    step * 4.0
}

fn axis_y(s: &mut String, left: f64, w: f64, base: f64, max: f64) {
    for k in 0..=4 {
        let v = max * k as f64 / 4.0;
        let y = base - (base - 10.0) * k as f64 / 4.0;
        let _ = write!(
            s,
            "<line x1=\"{left}\" x2=\"{w}\" y1=\"{y:.1}\" y2=\"{y:.1}\" stroke=\"#e5e7eb\"/>\
             <text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>",
            left - 4.0,
            y + 4.0,
            fmt_n(v)
        );
    }
}

/// Horizontal bars with labels.
fn hbars(items: &[(String, f64)], color: &str) -> String {
    let items = &items[..items.len().min(12)];
    let (w, row, left) = (480.0, 24.0, 170.0);
    let hgt = row * items.len().max(1) as f64 + 8.0;
    let max = items.iter().map(|x| x.1).fold(0.0, f64::max).max(1.0);
    let mut s = format!("<svg viewBox=\"0 0 {w} {hgt}\" width=\"100%\" role=\"img\">");
    for (i, (label, v)) in items.iter().enumerate() {
        let y = 4.0 + i as f64 * row;
        let bw = (v / max * (w - left - 60.0)).max(if *v > 0.0 { 2.0 } else { 0.0 });
        let _ = write!(
            s,
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>\
             <rect x=\"{left}\" y=\"{:.1}\" width=\"{bw:.1}\" height=\"{:.1}\" rx=\"3\" \
             fill=\"{color}\"/><text x=\"{:.1}\" y=\"{:.1}\">{}</text>",
            left - 6.0,
            y + row * 0.62,
            esc(label),
            y + 3.0,
            row - 6.0,
            left + bw + 5.0,
            y + row * 0.62,
            fmt_n(*v)
        );
    }
    s.push_str("</svg>");
    s
}

/// Vertical bars with a label per bar.
fn vbars(counts: &[f64], labels: &[String], color: &str) -> String {
    let (w, hgt, left, bottom) = (560.0, 200.0, 44.0, 30.0);
    let max = nice_top(counts.iter().copied().fold(0.0, f64::max));
    let bw = (w - left) / counts.len().max(1) as f64;
    let mut s = format!("<svg viewBox=\"0 0 {w} {hgt}\" width=\"100%\" role=\"img\">");
    axis_y(&mut s, left, w, hgt - bottom, max);
    let label_every = counts.len().div_ceil(12).max(1);
    for (i, c) in counts.iter().enumerate() {
        let bh = c / max * (hgt - bottom - 10.0);
        let x = left + i as f64 * bw;
        let _ = write!(
            s,
            "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{bh:.1}\" fill=\"{color}\">\
             <title>{}: {}</title></rect>",
            x + 2.0,
            hgt - bottom - bh,
            (bw - 4.0).max(1.0),
            esc(&labels[i]),
            fmt_n(*c)
        );
        if i % label_every == 0 {
            let _ = write!(
                s,
                "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>",
                x + bw / 2.0,
                hgt - 12.0,
                esc(&labels[i])
            );
        }
    }
    s.push_str("</svg>");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_formats_known_instants() {
        assert_eq!(utc(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(utc(1_764_460_800_000_000_000), "2025-11-30 00:00:00 UTC");
        assert_eq!(utc(951_782_400_000_000_000), "2000-02-29 00:00:00 UTC");
    }

    #[test]
    fn text_is_escaped() {
        assert_eq!(
            esc("<a href='x'>&\"</a>"),
            "&lt;a href=&#39;x&#39;&gt;&amp;&quot;&lt;/a&gt;"
        );
        let svg = hbars(&[("<script>".into(), 3.0)], "#000");
        assert!(!svg.contains("<script>") && svg.contains("&lt;script&gt;"));
    }
}
