//! The forensic questions, as documented SQL over the audit tables (`docs/forensics.md`).
//!
//! # "Could have seen", precisely
//! A request R (tenant T) on node N **could have seen** slot s of page P when a `page_reads` row of
//! R on N covers s (R attended it — with the tag check, or `unchecked` when the check was
//! disabled), and the **latest write** of (N, P, s) recorded before that read row — across all
//! generations, by the node's sequence number — was made for a request of another tenant U.
//! Then R received U's data in slot s. Reads are flushed when R ends, while R still holds its
//! pages, and nothing but R can write a page R holds (writes are tag-checked even when reads are
//! not), so "latest write before the read row" is exactly the content R attended.
//!
//! A read refused by the tag check is not a read: it is an `integrity_violations` row, listed as
//! a **prevented** exposure.
//!
//! Prefix-cache hits: a read of a page another request of the **same tenant** computed is not
//! foreign by the rule above; a read of a page its writer shared into an operator-declared
//! **public** scope (a `prefix_cache` `share` row in the page's generation, and the reader's
//! `hit` naming the same namespace) is a shared read, not an exposure — shared pages are
//! read-only, so the reader attended the declared prefix's K/V. Any other cross-tenant hit (the
//! `shared_prefix_cache` reproduction) is an exposure like any other.

use datafusion::arrow::array::AsArray;
use datafusion::arrow::compute::cast;
use datafusion::arrow::datatypes::{DataType, Int64Type, UInt32Type, UInt64Type};
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::prelude::SessionContext;

use crate::QueryError;

/// The exposure question's preparation: statements that leave in the session the tables its
/// answer ([`EXPOSURE_SQL`]) is read from, `exposure_candidates` — the suspect reads and every
/// write that can be the latest one before them — and `exposure_public_hits` (hits on pages
/// shared into a public scope). Linear in the log, and in an incident linear in
/// the faults, not in page reuse (`docs/forensics.md`, "At scale"):
///
/// 1. `exposure_spans`: one row per (node, page, request, tenant) — a *span* — over its writes
///    and reads (slot bitmasks for pages of up to 62 slots), in start order per page. A span's
///    reads are cleared in bulk when its own writes precede and cover them and no other span's
///    activity overlaps its own (the latest span to begin before it had ended before it began,
///    and the next began after it ended): then they attended only its own writes. The others
///    are `dirty`; on a clean log, the injected exposures' victims only.
/// 2. `exposure_epochs`, for pages with a dirty span: *anchors* — spans that wrote every slot any
///    earlier span of the page wrote, all before their own reads, and that began after every
///    earlier span had ended — cut each page's history into epochs. For a read at `s` of a span
///    in epoch `e` whose anchor's writes all precede `s`, the latest write of each slot before `s`
///    is the anchor's or later, and every write from the anchor's start to `s` belongs to a span
///    of epoch `e` (spans before the anchor ended before it; a span of a later epoch began after
///    that epoch's anchor, which began after this span ended). Such a read needs epoch `e`'s
///    writes only; any other dirty span (`far`: no such anchor, or reads beyond slot 61) needs
///    the page's whole history up to its epoch. A dirty span in an epoch whose one writing span
///    is its anchor (a prefix-cache hit's reader, or the anchor), the anchor's writes all before
///    the span's reads, attended only the anchor's writes (or unwritten slots): of the anchor's
///    tenant, or a hit on the page the anchor shared into a public scope, it is cleared here (no
///    slot matching); otherwise it is matched like any other.
/// 3. `exposure_candidates`: the dirty spans' reads and the writes of the epochs they need.
///
/// Writes and reads are views (each statement scans them where it uses them); spans, epochs and
/// candidates are tables, not views, because each is read twice.
pub const EXPOSURE_PREPARE_SQL: &str = r#"
-- Every page write, and every read in the window (views: inlined where used).
CREATE OR REPLACE VIEW exposure_writes AS
  SELECT node_id, page, seq, request_id, tenant, generation, slot_start, slot_end
  FROM all_page_events
  WHERE event = 'write';

CREATE OR REPLACE VIEW exposure_reads AS
  SELECT node_id, page, seq, request_id, tenant, slot_start, slot_end, wall_ns, verdict
  FROM all_page_reads
  WHERE wall_ns >= {from_ns} AND wall_ns < {to_ns};

CREATE OR REPLACE TABLE exposure_spans AS
WITH own AS (
  SELECT node_id, page, request_id, tenant,
         MIN(seq) AS start_seq,
         MAX(CASE WHEN is_read = 0 THEN seq END) AS last_write,
         MIN(CASE WHEN is_read = 1 THEN seq END) AS first_read,
         MAX(seq) AS end_seq,
         bit_or(CASE WHEN is_read = 0 THEN mask END) AS written,
         MAX(CASE WHEN is_read = 0 AND mask IS NULL THEN 1 ELSE 0 END) AS wide_write,
         bit_or(CASE WHEN is_read = 1 THEN mask END) AS attended
  FROM (
    SELECT node_id, page, request_id, tenant, seq, 0 AS is_read,
           CASE WHEN slot_end <= 62 THEN (CAST(1 AS BIGINT) << CAST(slot_end AS BIGINT))
                                       - (CAST(1 AS BIGINT) << CAST(slot_start AS BIGINT)) END AS mask
    FROM exposure_writes
    UNION ALL
    SELECT node_id, page, request_id, tenant, seq, 1 AS is_read,
           CASE WHEN slot_end <= 62 THEN (CAST(1 AS BIGINT) << CAST(slot_end AS BIGINT))
                                       - (CAST(1 AS BIGINT) << CAST(slot_start AS BIGINT))
                ELSE -1 END AS mask
    FROM exposure_reads
  ) AS x
  GROUP BY node_id, page, request_id, tenant
),
spans AS (
  SELECT node_id, page, request_id, tenant, start_seq, end_seq, last_write, first_read,
         written, wide_write, attended,
         COALESCE((written & attended) = attended AND last_write < first_read, FALSE) AS reads_own,
         MAX(end_seq) OVER (PARTITION BY node_id, page ORDER BY start_seq
                            ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS before_end,
         LEAD(start_seq) OVER (PARTITION BY node_id, page ORDER BY start_seq) AS next_start
  FROM own
)
SELECT node_id, page, request_id, tenant, start_seq, last_write, first_read, written, wide_write,
       attended, before_end,
       first_read IS NOT NULL
         AND NOT (reads_own AND NOT COALESCE(before_end >= start_seq OR next_start <= end_seq, FALSE))
         AS dirty
FROM spans;

-- Hits on pages their writer shared into an operator-declared public scope: the writer's
-- `share` row in the page's generation, the reader's `hit` naming the same namespace. A shared
-- page is read-only (its writes are refused by the tag check), so such a read attended the
-- public prefix's KV, not the writer's tenant's data. Read by the epochs' bulk clearing and by
-- the answer.
-- A page restored from a KV offload tier is written (`page_events`, writer `restore`) by its
-- original writer: it counts as shared into a public scope when the restore names that scope
-- and the reader's hit names the same namespace.
CREATE OR REPLACE TABLE exposure_public_hits AS
  SELECT DISTINCT h.node_id, h.request_id, h.page, h.generation, s.request_id AS writer
  FROM all_prefix_cache h
  JOIN all_prefix_cache s
    ON s.node_id = h.node_id AND s.page = h.page AND s.generation = h.generation
   AND s.namespace = h.namespace
  WHERE h.event = 'hit' AND s.event = 'share' AND s.scope_kind = 'public'
  UNION
  SELECT DISTINCT h.node_id, h.request_id, h.page, h.generation, r.writer_request_id AS writer
  FROM all_prefix_cache h
  JOIN all_kv_offload r
    ON r.node_id = h.node_id AND r.page = h.page AND r.generation = h.generation
   AND r.namespace = h.namespace
  WHERE h.event = 'hit' AND h.scope_kind = 'public' AND r.event = 'restore'
    AND r.scope LIKE 'public:%';

CREATE OR REPLACE TABLE exposure_epochs AS
WITH covered AS (
  SELECT s.node_id, s.page, s.request_id, s.tenant, s.start_seq, s.last_write, s.first_read,
         s.written, s.attended, s.before_end, s.dirty,
         bit_or(CASE WHEN s.wide_write = 1 THEN -1 ELSE s.written END)
           OVER (PARTITION BY s.node_id, s.page ORDER BY s.start_seq
                 ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS written_so_far
  FROM (SELECT DISTINCT node_id, page FROM exposure_spans WHERE dirty) AS d
  JOIN exposure_spans s ON s.node_id = d.node_id AND s.page = d.page
),
marked AS (
  SELECT node_id, page, request_id, tenant, start_seq, last_write, first_read, attended, dirty,
         CASE WHEN COALESCE(written = written_so_far, FALSE)
                   AND COALESCE(before_end < start_seq, TRUE)
                   AND COALESCE(last_write < first_read, TRUE)
              THEN 1 ELSE 0 END AS anchor
  FROM covered
),
epochs AS (
  SELECT node_id, page, request_id, tenant, last_write, first_read, attended, dirty, anchor,
         SUM(anchor) OVER (PARTITION BY node_id, page ORDER BY start_seq
                           ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS epoch,
         MAX(CASE WHEN anchor = 1 THEN last_write END)
           OVER (PARTITION BY node_id, page ORDER BY start_seq
                 ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS anchor_last_write
  FROM marked
),
-- Per epoch: its anchor (one per epoch > 0) and how many of its spans wrote.
anchors AS (
  SELECT node_id, page, epoch, request_id AS anchor_request, tenant AS anchor_tenant
  FROM epochs WHERE anchor = 1
),

writers AS (
  SELECT node_id, page, epoch, COUNT(last_write) AS n_writers
  FROM epochs GROUP BY node_id, page, epoch
),
-- A dirty span in an epoch whose one writing span is its anchor (a prefix-cache hit's reader,
-- or the anchor itself), all of the anchor's writes preceding the span's reads: each slot it
-- attended was last written by the anchor (no other span of the epoch writes; a later epoch
-- began after it ended), or by nobody (the anchor wrote every slot any earlier span wrote). Of
-- the anchor's tenant, or a hit on the page the anchor shared into a public scope: no foreign
-- slot, so it needs no matching.
resolved AS (
  SELECT e.node_id, e.page, e.request_id, e.tenant, e.epoch, e.attended, e.first_read,
         e.anchor_last_write,
         e.dirty AND NOT COALESCE(
           e.epoch > 0 AND w.n_writers = 1 AND e.anchor_last_write < e.first_read
           AND (a.anchor_tenant = e.tenant OR p.writer IS NOT NULL),
           FALSE) AS dirty
  FROM epochs e
  LEFT JOIN anchors a ON a.node_id = e.node_id AND a.page = e.page AND a.epoch = e.epoch
  LEFT JOIN writers w ON w.node_id = e.node_id AND w.page = e.page AND w.epoch = e.epoch
  LEFT JOIN exposure_public_hits p
    ON p.node_id = e.node_id AND p.request_id = e.request_id AND p.page = e.page
   AND p.writer = a.anchor_request
)
SELECT node_id, page, request_id, tenant, epoch, dirty,
       dirty AND NOT COALESCE(epoch > 0 AND anchor_last_write < first_read AND attended <> -1,
                              FALSE) AS far
FROM resolved;

DROP TABLE exposure_spans;

CREATE OR REPLACE TABLE exposure_candidates AS
WITH needed AS (SELECT DISTINCT node_id, page, epoch FROM exposure_epochs WHERE dirty),
far_pages AS (
  SELECT node_id, page, MAX(epoch) AS far_epoch FROM exposure_epochs WHERE far
  GROUP BY node_id, page
),
kept AS (
  SELECT node_id, page, request_id, tenant, bool_or(reads) AS reads
  FROM (
    SELECT s.node_id, s.page, s.request_id, s.tenant, s.dirty AS reads
    FROM needed n JOIN exposure_epochs s
      ON s.node_id = n.node_id AND s.page = n.page AND s.epoch = n.epoch
    UNION ALL
    SELECT s.node_id, s.page, s.request_id, s.tenant, FALSE AS reads
    FROM far_pages f JOIN exposure_epochs s
      ON s.node_id = f.node_id AND s.page = f.page AND s.epoch < f.far_epoch
  ) AS k
  GROUP BY node_id, page, request_id, tenant
)
SELECT x.node_id, x.page, x.seq, x.tenant, x.request_id, x.is_read, x.generation,
       x.slot_start, x.slot_end, x.wall_ns, x.verdict
FROM kept k
JOIN (
  SELECT node_id, page, request_id, tenant, seq, 0 AS is_read, generation, slot_start, slot_end,
         CAST(NULL AS BIGINT) AS wall_ns, CAST(NULL AS VARCHAR) AS verdict
  FROM exposure_writes
  UNION ALL
  SELECT node_id, page, request_id, tenant, seq, 1 AS is_read, CAST(NULL AS BIGINT),
         slot_start, slot_end, wall_ns, verdict
  FROM exposure_reads
) AS x
  ON x.node_id = k.node_id AND x.page = k.page AND x.request_id = k.request_id
 AND x.tenant = k.tenant
WHERE x.is_read = 0 OR k.reads;

DROP TABLE exposure_epochs;

DROP VIEW exposure_writes;

DROP VIEW exposure_reads;
"#;

/// The reads in the window that attended a slot another request wrote last (a candidate's
/// latest write before the read), with the writer's request and tenant: what [`EXPOSURE_SQL`]
/// and [`EXPOSURE_SOURCES_SQL`] aggregate. A macro, so that both are one literal each.
macro_rules! exposure_sourced_cte {
    () => {
        r#"
WITH slotted AS (
  SELECT node_id, page, seq, request_id, tenant, is_read, wall_ns, verdict,
         unnest(range(slot_start, slot_end)) AS slot
  FROM exposure_candidates
),
-- The latest candidate write of each read's slot before it: per page, in (slot, seq) order, the
-- running maximum of the writes' (slot, seq) keys: it is this slot's write if its slot is this
-- slot's (the key is at least the slot's base), else the slot has no earlier write.
keyed AS (
  SELECT node_id, page, seq, request_id, tenant, is_read, wall_ns, verdict, slot,
         CAST(slot AS DECIMAL(38, 0)) * CAST(100000000000000000000 AS DECIMAL(38, 0)) AS base
  FROM slotted
),
latest AS (
  SELECT node_id, page, request_id, tenant, is_read, wall_ns, verdict,
         CAST(key_max - base AS BIGINT) AS write_seq
  FROM (
    SELECT node_id, page, request_id, tenant, is_read, wall_ns, verdict, base,
           MAX(CASE WHEN is_read = 0 THEN base + CAST(seq AS DECIMAL(38, 0)) END)
             OVER (PARTITION BY node_id, page ORDER BY slot, seq
                   ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS key_max
    FROM keyed
  ) AS k
  WHERE is_read = 1 AND key_max >= base
),
sourced AS (
  SELECT l.node_id, l.request_id, l.tenant, c.tenant AS source_tenant, l.wall_ns, l.verdict,
         c.request_id AS source_request
  FROM latest l
  JOIN exposure_candidates c
    ON c.node_id = l.node_id AND c.seq = l.write_seq AND c.is_read = 0
  LEFT JOIN exposure_public_hits p
    ON p.node_id = l.node_id AND p.request_id = l.request_id AND p.page = c.page
   AND p.generation = c.generation AND p.writer = c.request_id
  WHERE p.node_id IS NULL
)
"#
    };
}

/// Every attended slot whose latest earlier write was another tenant's: one row per affected
/// response and source tenant. Reads the tables [`EXPOSURE_PREPARE_SQL`] leaves: each suspect
/// read's slots are matched with the latest candidate write before them (an as-of match by one
/// ordered pass, not a join with the page's history).
pub const EXPOSURE_SQL: &str = concat!(
    exposure_sourced_cte!(),
    r#"SELECT node_id, request_id, tenant AS recipient_tenant, source_tenant,
       CAST(COUNT(*) AS BIGINT) AS foreign_slots, MIN(wall_ns) AS wall_ns,
       MAX(CASE WHEN verdict = 'unchecked' THEN 1 ELSE 0 END) AS unchecked,
       MAX(wall_ns) AS last_wall_ns
FROM sourced
WHERE source_tenant <> tenant
GROUP BY node_id, request_id, tenant, source_tenant
ORDER BY node_id, request_id, recipient_tenant, source_tenant
"#
);

/// [`EXPOSURE_SQL`] per writing request: for each affected response and source tenant, which of
/// that tenant's requests wrote the slots it attended, and how many (what a source tenant's
/// notice names: `custody forensics notify`).
pub const EXPOSURE_SOURCES_SQL: &str = concat!(
    exposure_sourced_cte!(),
    r#"SELECT node_id, request_id, tenant AS recipient_tenant, source_tenant, source_request,
       CAST(COUNT(*) AS BIGINT) AS foreign_slots, MIN(wall_ns) AS wall_ns,
       MAX(CASE WHEN verdict = 'unchecked' THEN 1 ELSE 0 END) AS unchecked,
       MAX(wall_ns) AS last_wall_ns
FROM sourced
WHERE source_tenant <> tenant
GROUP BY node_id, request_id, tenant, source_tenant, source_request
ORDER BY node_id, request_id, recipient_tenant, source_tenant, source_request
"#
);

/// [`EXPOSURE_SQL`]'s order: every column of its group key, so the order is total — a node's
/// request ids restart with its process, and two incarnations' responses of one id (each its own
/// row: another recipient) would otherwise tie.
const EXPOSURE_ORDER: &str = "ORDER BY node_id, request_id, recipient_tenant, source_tenant";

/// DataFusion settings under which the forensic SQL runs at scale (10⁸ events in about 20 s on 2
/// cores, `BENCHMARKS.md`): evaluate filters inside the Parquet reader (only matching rows are
/// decoded), sort each partition in one piece, aggregate without a partial phase (the groups are
/// nearly as many as the rows), and keep the joins' build sides as written (the small side: the
/// suspect reads). [`tuned`] applies them; `--show-sql` prints them as `SET` statements.
pub const SETTINGS: [(&str, &str); 4] = [
    ("datafusion.execution.parquet.pushdown_filters", "true"),
    (
        "datafusion.execution.sort_in_place_threshold_bytes",
        "4294967296",
    ),
    (
        "datafusion.execution.skip_partial_aggregation_probe_ratio_threshold",
        "0.1",
    ),
    ("datafusion.optimizer.join_reordering", "false"),
];

/// A context over the same tables and views as `ctx`, with [`SETTINGS`].
pub fn tuned(ctx: &SessionContext) -> Result<SessionContext, QueryError> {
    // A copy of the state shares the catalog (tables, `all_*` views); only its options differ.
    let mut state = ctx.state();
    for (key, value) in SETTINGS {
        state.config_mut().options_mut().set(key, value)?;
    }
    Ok(SessionContext::new_with_state(state))
}

/// [`SETTINGS`] as SQL `SET` statements (each ending with `;`).
pub fn settings_sql() -> String {
    SETTINGS
        .iter()
        .map(|(k, v)| format!("SET {k} = {v};\n"))
        .collect()
}

/// A canned query as `--show-sql` prints it: the [`SETTINGS`] as `SET` statements, then `sql`,
/// `;`-terminated — a script that `custody query -c` or `-f` (and [`crate::run_script`]) runs as
/// printed.
pub fn script(sql: &str) -> String {
    format!("{}{};\n", settings_sql(), sql.trim())
}

/// The exposure question as `--show-sql` prints it (a runnable script): the settings, the
/// preparation ([`EXPOSURE_PREPARE_SQL`]), the affected responses per source tenant
/// ([`EXPOSURE_SQL`]), the prevented exposures.
pub fn exposure_script(from_ns: Option<i64>, to_ns: Option<i64>) -> String {
    format!(
        "-- settings under which it scales (docs/forensics.md)\n{}\
         -- the suspect reads and their candidate writes (tables exposure_*)\n{}\n\
         -- affected responses, per source tenant\n{};\n\
         -- prevented exposures (reads the tag check refused)\n{};\n",
        settings_sql(),
        with_window(EXPOSURE_PREPARE_SQL, from_ns, to_ns).trim(),
        with_window(EXPOSURE_SQL, from_ns, to_ns).trim(),
        with_window(PREVENTED_SQL, from_ns, to_ns).trim()
    )
}

/// Leave in `ctx`'s catalog the table [`EXPOSURE_SQL`] reads ([`EXPOSURE_PREPARE_SQL`], under
/// [`SETTINGS`]). Two preparations at once on one catalog would replace each other's tables.
pub async fn prepare_exposure(
    ctx: &SessionContext,
    from_ns: Option<i64>,
    to_ns: Option<i64>,
) -> Result<(), QueryError> {
    let prepare = with_window(EXPOSURE_PREPARE_SQL, from_ns, to_ns);
    crate::run_script(&tuned(ctx)?, &prepare).await?;
    Ok(())
}

/// Drop what [`prepare_exposure`] left (its memory: the suspect reads and candidate writes).
pub async fn drop_exposure_tables(ctx: &SessionContext) -> Result<(), QueryError> {
    crate::run_script(ctx, "DROP TABLE IF EXISTS exposure_candidates").await?;
    Ok(())
}

/// Blast radius of tenant `{tenant}`: every (recipient, source) pair of the exposure answer that
/// involves it — whose data it could have seen (`direction = 'received'`) and who could have seen
/// its data (`direction = 'exposed_to'`).
pub const TENANT_SQL: &str = r#"
WITH e AS ({exposure})
SELECT 'received' AS direction, source_tenant AS other_tenant,
       CAST(COUNT(*) AS BIGINT) AS responses, CAST(SUM(foreign_slots) AS BIGINT) AS foreign_slots
FROM e WHERE recipient_tenant = '{tenant}' GROUP BY source_tenant
UNION ALL
SELECT 'exposed_to' AS direction, recipient_tenant AS other_tenant,
       CAST(COUNT(*) AS BIGINT) AS responses, CAST(SUM(foreign_slots) AS BIGINT) AS foreign_slots
FROM e WHERE source_tenant = '{tenant}' GROUP BY recipient_tenant
ORDER BY direction, other_tenant
"#;

/// Prefix-cache hits by reader and writer tenant, scope kind and where the page came from
/// (`served_from`: `pool`, or the KV offload tier it was restored from for this reader — a
/// restore is a write by the page's original writer): who attended pages another request
/// computed. `cross_tenant` hits are legitimate only in a `public` scope (an operator-declared
/// prefix); any other is a leak the exposure question reports too.
pub const CACHE_SQL: &str = r#"
SELECT h.node_id, h.tenant AS reader_tenant, h.writer_tenant, h.scope_kind, h.scope,
       h.tenant <> h.writer_tenant AS cross_tenant,
       COALESCE(o.tier, 'pool') AS served_from,
       CAST(COUNT(DISTINCT h.request_id) AS BIGINT) AS requests,
       CAST(COUNT(*) AS BIGINT) AS pages
FROM all_prefix_cache h
LEFT JOIN (SELECT DISTINCT node_id, request_id, page, generation, tier
           FROM all_kv_offload WHERE event = 'restore') o
  ON o.node_id = h.node_id AND o.request_id = h.request_id AND o.page = h.page
 AND o.generation = h.generation
WHERE h.event = 'hit'
GROUP BY h.node_id, h.tenant, h.writer_tenant, h.scope_kind, h.scope, COALESCE(o.tier, 'pool')
ORDER BY node_id, reader_tenant, writer_tenant, scope_kind, scope, served_from
"#;

/// The timeline of request `{request}` on node `{node}`: admission, every page it held (and who
/// wrote it), transfers, reads, violations, release — in the node's sequence order.
pub const REQUEST_SQL: &str = r#"
SELECT seq, wall_ns, 'request' AS what, event AS detail, CAST(NULL AS INT) AS page,
       CAST(NULL AS INT) AS generation, reason AS info
  FROM all_requests WHERE node_id = {node} AND request_id = {request}
UNION ALL
SELECT seq, wall_ns, 'page', event, CAST(page AS INT), CAST(generation AS INT),
       CONCAT(COALESCE(writer, ''), ' ', COALESCE(CAST(slot_start AS VARCHAR), ''), '..', COALESCE(CAST(slot_end AS VARCHAR), ''))
  FROM all_page_events WHERE node_id = {node} AND request_id = {request}
UNION ALL
SELECT seq, wall_ns, 'transfer', outcome, CAST(dst_page AS INT), CAST(dst_generation AS INT),
       CONCAT('transfer ', CAST(transfer_id AS VARCHAR), ' from node ', CAST(src_node AS VARCHAR), ', ', CAST(bytes AS VARCHAR), ' B')
  FROM all_transfers WHERE node_id = {node} AND request_id = {request}
UNION ALL
SELECT seq, wall_ns, 'cache', event, CAST(page AS INT), CAST(generation AS INT),
       CONCAT(scope, ' ', namespace, ', written by request ', CAST(writer_request_id AS VARCHAR),
              ' (', writer_tenant, ')',
              CASE WHEN event = 'hit' THEN CONCAT(', ', CAST(hit_tokens AS VARCHAR), ' prompt tokens cached') ELSE '' END)
  FROM all_prefix_cache WHERE node_id = {node} AND request_id = {request}
UNION ALL
SELECT seq, wall_ns, 'read', verdict, CAST(page AS INT), CAST(generation AS INT),
       CONCAT('slots ', CAST(slot_start AS VARCHAR), '..', CAST(slot_end AS VARCHAR), ', steps ', CAST(first_step AS VARCHAR), '..', CAST(last_step AS VARCHAR))
  FROM all_page_reads WHERE node_id = {node} AND request_id = {request}
UNION ALL
SELECT seq, wall_ns, 'violation', kind, CAST(page AS INT), CAST(generation AS INT), detail
  FROM all_integrity_violations WHERE node_id = {node} AND request_id = {request}
UNION ALL
SELECT seq, wall_ns, 'decoding', COALESCE(constraint_kind, 'unconstrained'), CAST(NULL AS INT),
       CAST(NULL AS INT),
       CONCAT('constraint sha256 ', COALESCE(constraint_sha256, '-'), ', n ', CAST(n AS VARCHAR),
              ', top_logprobs ', COALESCE(CAST(top_logprobs AS VARCHAR), '-'),
              ', logit_bias ', CAST(logit_bias_tokens AS VARCHAR), ' tokens, penalties (milli) ',
              CAST(presence_penalty_milli AS VARCHAR), ' / ', CAST(frequency_penalty_milli AS VARCHAR))
  FROM all_request_decoding WHERE node_id = {node} AND request_id = {request}
UNION ALL
SELECT seq, wall_ns, 'tools', tool_choice, CAST(NULL AS INT), CAST(NULL AS INT),
       CONCAT('format ', format, ', offered [', offered, '], called [', called, ']')
  FROM all_request_tools WHERE node_id = {node} AND request_id = {request}
ORDER BY seq
"#;

/// Anomalies, one row each: `kind`, node, request, and a detail. Kinds:
/// - `short_transfer`: a decode-side request whose prompt was not fully delivered — fewer slots
///   written by transfer than its prompt has (the incident's "prefill faster than physically
///   possible": 1 token computed for a long prompt);
/// - `read_without_write`: a read of a (page, generation) that has no write in that generation
///   (the request attended slots nobody wrote for it);
/// - `transfer_not_completed`: a transfer whose outcome is not `completed`/`verified`;
/// - `sequence_gap`: a node whose sequence numbers (across all tables) have holes — rows missing.
pub const ANOMALIES_SQL: &str = r#"
WITH xfer AS (
  SELECT node_id, request_id, SUM(slot_end - slot_start) AS slots
  FROM all_page_events WHERE event = 'write' AND writer = 'transfer'
  GROUP BY node_id, request_id
),
adm AS (
  SELECT node_id, request_id, MAX(prompt_tokens) AS prompt_tokens
  FROM all_requests WHERE event = 'admitted' GROUP BY node_id, request_id
),
seqs AS (
  SELECT node_id, seq FROM all_requests UNION ALL SELECT node_id, seq FROM all_page_events
  UNION ALL SELECT node_id, seq FROM all_page_reads UNION ALL SELECT node_id, seq FROM all_transfers
  UNION ALL SELECT node_id, seq FROM all_integrity_violations UNION ALL SELECT node_id, seq FROM all_writer_events
  UNION ALL SELECT node_id, seq FROM all_node_events UNION ALL SELECT node_id, seq FROM all_rdma_ops
  UNION ALL SELECT node_id, seq FROM all_rdma_mr
)
SELECT 'short_transfer' AS kind, a.node_id, a.request_id,
       CONCAT('prompt of ', CAST(a.prompt_tokens AS VARCHAR), ' tokens, ', CAST(x.slots AS VARCHAR), ' slots transferred') AS detail
  FROM adm a JOIN xfer x ON a.node_id = x.node_id AND a.request_id = x.request_id
  WHERE x.slots < a.prompt_tokens
UNION ALL
SELECT 'read_without_write', r.node_id, r.request_id,
       CONCAT('page ', CAST(r.page AS VARCHAR), ' generation ', CAST(r.generation AS VARCHAR), ' read (', r.verdict, ') with no write in that generation')
  FROM all_page_reads r LEFT JOIN (SELECT DISTINCT node_id, page, generation FROM all_page_events WHERE event = 'write') w
    ON r.node_id = w.node_id AND r.page = w.page AND r.generation = w.generation
  WHERE w.page IS NULL
UNION ALL
SELECT 'transfer_not_completed', node_id, request_id,
       CONCAT('transfer ', CAST(transfer_id AS VARCHAR), ': ', outcome)
  FROM all_transfers WHERE outcome <> 'completed' AND outcome <> 'verified'
UNION ALL
SELECT 'sequence_gap', node_id, CAST(NULL AS BIGINT UNSIGNED),
       CONCAT(CAST(MAX(seq) - MIN(seq) + 1 - COUNT(*) AS VARCHAR), ' rows missing between seq ', CAST(MIN(seq) AS VARCHAR), ' and ', CAST(MAX(seq) AS VARCHAR))
  FROM seqs GROUP BY node_id HAVING MAX(seq) - MIN(seq) + 1 <> COUNT(*)
ORDER BY kind, node_id, request_id, detail
"#;

/// The eBPF witness's observed writes (`rdma_ops`, `op = 'post_write'`) against the engine's
/// record (`transfers`), one row per discrepancy: `kind`, the initiating node, the `wr_id`, and
/// both sides (`engine`, `witness`). An observed write belongs to node `ctx >> 32` (the probe
/// context's node) and to the transfer with its `wr_id`. Kinds:
/// - `transfer_mismatch`: a transfer the initiator recorded whose observed writes differ — not as
///   many as its chain had (`work_requests`), not as many bytes (`wire_bytes`), or some outside
///   its key and page span (`rkey`, `[remote_addr, remote_addr + remote_len)`); a missing write
///   is one of these;
/// - `unrecorded_write`: an observed write whose wr_id no transfer has;
/// - `stale_write`: an observed write that landed — per the target's record of which page each
///   (key, region offset) is — in the very page its transfer names, but in another generation:
///   the page had been reallocated to another request;
/// - `misdirected_write`: an observed write that landed outside its transfer's key and page in
///   any other way.
///
/// Where it landed comes from the target node's own rows (`node_id = dst_node`: key, page
/// address and span → request, page, generation). Keys are never reused within a transport's
/// life, so a (key, offset) names one page of one reservation for the key's whole life.
pub const CROSSCHECK_SQL: &str = r#"
WITH obs AS (
  SELECT CAST(ctx / 4294967296 AS BIGINT) AS src_node, wr_id, rkey, remote_addr, bytes
  FROM all_rdma_ops WHERE op = 'post_write'
),
eng AS (
  SELECT CAST(src_node AS BIGINT) AS src_node, transfer_id, request_id, tenant, dst_page,
         dst_generation, rkey, remote_addr, remote_len, wire_bytes, work_requests
  FROM all_transfers WHERE node_id = src_node
),
landing AS (
  SELECT request_id AS l_request, tenant AS l_tenant, dst_page AS l_page,
         dst_generation AS l_generation, rkey AS l_rkey, remote_addr AS l_addr, remote_len AS l_len
  FROM all_transfers WHERE node_id = dst_node
),
per_transfer AS (
  SELECT e.src_node, e.transfer_id, e.request_id, e.tenant, e.dst_page, e.dst_generation, e.rkey,
         e.remote_addr, e.remote_len, e.wire_bytes, e.work_requests,
         COUNT(o.wr_id) AS seen_writes, COALESCE(SUM(o.bytes), 0) AS seen_bytes,
         SUM(CASE WHEN o.wr_id IS NOT NULL AND (o.rkey <> e.rkey OR o.remote_addr < e.remote_addr
                  OR o.remote_addr + o.bytes > e.remote_addr + e.remote_len) THEN 1 ELSE 0 END) AS outside
  FROM eng e LEFT JOIN obs o ON o.src_node = e.src_node AND o.wr_id = e.transfer_id
  GROUP BY e.src_node, e.transfer_id, e.request_id, e.tenant, e.dst_page, e.dst_generation, e.rkey,
           e.remote_addr, e.remote_len, e.wire_bytes, e.work_requests
)
SELECT 'transfer_mismatch' AS kind, src_node, transfer_id AS wr_id,
       CONCAT('request ', CAST(request_id AS VARCHAR), ' (', tenant, ') page ', CAST(dst_page AS VARCHAR),
              ' gen ', CAST(dst_generation AS VARCHAR), ': ', CAST(work_requests AS VARCHAR), ' writes, ',
              CAST(wire_bytes AS VARCHAR), ' B, key ', CAST(rkey AS VARCHAR), ' at ', CAST(remote_addr AS VARCHAR),
              '+', CAST(remote_len AS VARCHAR)) AS engine,
       CONCAT(CAST(seen_writes AS VARCHAR), ' writes, ', CAST(seen_bytes AS VARCHAR), ' B, ',
              CAST(outside AS VARCHAR), ' outside the page') AS witness
  FROM per_transfer
  WHERE seen_writes <> work_requests OR seen_bytes <> wire_bytes OR outside > 0
UNION ALL
SELECT CASE WHEN e.transfer_id IS NULL THEN 'unrecorded_write'
            WHEN l.l_page = e.dst_page AND l.l_generation <> e.dst_generation THEN 'stale_write'
            ELSE 'misdirected_write' END,
       o.src_node, o.wr_id,
       CASE WHEN e.transfer_id IS NULL THEN 'no transfer with this wr_id'
            ELSE CONCAT('request ', CAST(e.request_id AS VARCHAR), ' (', e.tenant, ') page ',
                        CAST(e.dst_page AS VARCHAR), ' gen ', CAST(e.dst_generation AS VARCHAR), ', key ',
                        CAST(e.rkey AS VARCHAR), ' at ', CAST(e.remote_addr AS VARCHAR), '+',
                        CAST(e.remote_len AS VARCHAR)) END,
       CONCAT('write of ', CAST(o.bytes AS VARCHAR), ' B with key ', CAST(o.rkey AS VARCHAR), ' at ',
              CAST(o.remote_addr AS VARCHAR), ' landed in ',
              -- CONCAT skips NULLs (it never returns NULL): test for the missing landing row.
              CASE WHEN l.l_page IS NULL THEN 'no page the target recorded'
                   ELSE CONCAT('page ', CAST(l.l_page AS VARCHAR), ' gen ', CAST(l.l_generation AS VARCHAR),
                               ' of request ', CAST(l.l_request AS VARCHAR), ' (', l.l_tenant, ')') END)
  FROM obs o
  LEFT JOIN eng e ON o.src_node = e.src_node AND o.wr_id = e.transfer_id
  LEFT JOIN landing l ON l.l_rkey = o.rkey AND o.remote_addr >= l.l_addr AND o.remote_addr < l.l_addr + l.l_len
  WHERE e.transfer_id IS NULL OR o.rkey <> e.rkey OR o.remote_addr < e.remote_addr
     OR o.remote_addr + o.bytes > e.remote_addr + e.remote_len
ORDER BY kind, src_node, wr_id, engine, witness
"#;

/// What the cross-check compared.
pub const CROSSCHECK_COUNTS_SQL: &str = r#"
SELECT (SELECT COUNT(*) FROM all_transfers WHERE node_id = src_node) AS engine_transfers,
       (SELECT COALESCE(SUM(work_requests), 0) FROM all_transfers WHERE node_id = src_node) AS engine_writes,
       (SELECT COUNT(*) FROM all_rdma_ops WHERE op = 'post_write') AS observed_writes,
       (SELECT COUNT(*) FROM all_node_events WHERE event = 'witness_lost') AS witness_loss_reports
"#;

/// One discrepancy between the engine's record and the witness's observations.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Discrepancy {
    pub kind: String,
    pub src_node: i64,
    pub wr_id: u64,
    pub engine: String,
    pub witness: String,
}

/// The cross-check's answer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Crosscheck {
    pub engine_transfers: i64,
    pub engine_writes: i64,
    pub observed_writes: i64,
    /// `witness_lost` rows: the witness reported lost events (its view is incomplete).
    pub witness_loss_reports: i64,
    pub discrepancies: Vec<Discrepancy>,
}

impl Crosscheck {
    /// The witness saw something and nothing disagrees.
    pub fn clean(&self) -> bool {
        self.discrepancies.is_empty() && self.witness_loss_reports == 0
    }

    pub fn summary(&self) -> String {
        format!(
            "engine transfers (initiator rows): {}\nengine work requests: {}\nwitness-observed writes: {}\nwitness loss reports: {}\ndiscrepancies: {}",
            self.engine_transfers,
            self.engine_writes,
            self.observed_writes,
            self.witness_loss_reports,
            self.discrepancies.len()
        )
    }
}

/// Column `i` of `b` cast to `to` (SQL arithmetic and unions choose widths and signedness the
/// caller should not depend on; strings may come back as views).
fn column_as(
    b: &datafusion::arrow::array::RecordBatch,
    i: usize,
    to: &DataType,
) -> Result<datafusion::arrow::array::ArrayRef, QueryError> {
    cast(b.column(i), to)
        .map_err(|e| QueryError::DataFusion(datafusion::error::DataFusionError::from(e)))
}

/// Run the cross-check over a session prepared by [`crate::prepare_forensics`].
pub async fn crosscheck(ctx: &SessionContext) -> Result<Crosscheck, QueryError> {
    let mut out = Crosscheck::default();
    for b in ctx.sql(CROSSCHECK_COUNTS_SQL).await?.collect().await? {
        if b.num_rows() > 0 {
            let mut v = [0i64; 4];
            for (i, x) in v.iter_mut().enumerate() {
                *x = column_as(&b, i, &DataType::Int64)?
                    .as_primitive::<Int64Type>()
                    .value(0);
            }
            [
                out.engine_transfers,
                out.engine_writes,
                out.observed_writes,
                out.witness_loss_reports,
            ] = v;
        }
    }
    for b in ctx.sql(CROSSCHECK_SQL).await?.collect().await? {
        let (kind, node, wr, eng, wit) = (
            column_as(&b, 0, &DataType::Utf8)?,
            column_as(&b, 1, &DataType::Int64)?,
            column_as(&b, 2, &DataType::UInt64)?,
            column_as(&b, 3, &DataType::Utf8)?,
            column_as(&b, 4, &DataType::Utf8)?,
        );
        let (kind, eng, wit) = (
            kind.as_string::<i32>(),
            eng.as_string::<i32>(),
            wit.as_string::<i32>(),
        );
        let (node, wr) = (
            node.as_primitive::<Int64Type>(),
            wr.as_primitive::<UInt64Type>(),
        );
        for i in 0..b.num_rows() {
            out.discrepancies.push(Discrepancy {
                kind: kind.value(i).to_owned(),
                src_node: node.value(i),
                wr_id: wr.value(i),
                engine: eng.value(i).to_owned(),
                witness: wit.value(i).to_owned(),
            });
        }
    }
    Ok(out)
}

/// The tenant question for `tenant` (quotes in the id are escaped), as a script: the exposure
/// preparation, then [`TENANT_SQL`] over [`EXPOSURE_SQL`] (run it with [`crate::run_script`];
/// its one result is the answer).
pub fn tenant_sql(tenant: &str, from_ns: Option<i64>, to_ns: Option<i64>) -> String {
    let exposure = with_window(EXPOSURE_SQL, from_ns, to_ns);
    let exposure = exposure.trim().replace(EXPOSURE_ORDER, "");
    let question = TENANT_SQL
        .replace("{exposure}", &exposure)
        .replace("{tenant}", &tenant.replace('\'', "''"));
    format!(
        "{}\n{};\n",
        with_window(EXPOSURE_PREPARE_SQL, from_ns, to_ns).trim(),
        question.trim()
    )
}

/// The request timeline for (`node`, `request`).
pub fn request_sql(node: u32, request: u64) -> String {
    REQUEST_SQL
        .replace("{node}", &node.to_string())
        .replace("{request}", &request.to_string())
}

/// Every `route` row of every node in the root (`node_events` kind `route`), its fields parsed
/// from `detail`: the router's rows carry an `outcome` (`chosen`, `admitted`, `retry`, `failed`,
/// `refused`, `finished`, `ended`), the prefill and decode nodes' rows do not (they bind the
/// router's transfer id to their own request id). Ids stay text: a transfer id uses all 64 bits.
const ROUTES_CTE: &str = r#"routes AS (
  SELECT node_id, seq, wall_ns, detail,
    regexp_match(detail, '(?:^| )transfer=([0-9]+)')[1] AS transfer,
    regexp_match(detail, '(?:^| )request=([0-9]+)')[1] AS request,
    regexp_match(detail, '(?:^| )prefill=([0-9]+)')[1] AS prefill,
    regexp_match(detail, '(?:^| )decode=([0-9]+)')[1] AS decode,
    regexp_match(detail, '(?:^| )epoch=([0-9]+)')[1] AS epoch,
    regexp_match(detail, '(?:^| )outcome=([a-z]+)')[1] AS outcome,
    regexp_match(detail, '(?:^| )prefill_request=([0-9]+)')[1] AS prefill_request
  FROM all_node_events WHERE event = 'route'
),
router AS (SELECT * FROM routes WHERE outcome IS NOT NULL),
pnode AS (SELECT * FROM routes WHERE outcome IS NULL AND CAST(node_id AS VARCHAR) = prefill),
dnode AS (SELECT * FROM routes WHERE outcome IS NULL AND CAST(node_id AS VARCHAR) = decode),
chosen AS (SELECT * FROM router WHERE outcome = 'chosen')"#;

/// The fleet's logs against each other: one row per disagreement between the router's record
/// of its routes and the prefill and decode nodes' records (empty: they tell the same story).
/// A node's request ids restart with its process, so each node-side route row is scoped to its
/// incarnation: from the row to the node's next `start` row (sequence numbers continue across
/// restarts). Kinds:
/// - `admitted_without_prefill_record` / `admitted_without_decode_record`: the router says a
///   prefill node admitted the request under a transfer id (its first event came back, after the
///   transfer); that prefill node's, or any decode node's, log has no route row for it;
/// - `prefill_route_not_minted` / `decode_route_not_minted`: a node acted on a route (transfer
///   id, prefill, decode, epoch) the router never chose — a forged or replayed route;
/// - `decode_route_without_prefill`: a decode node reserved for a route no prefill node
///   recorded;
/// - `retried_after_write`: the router retried an attempt although the prefill node recorded a
///   KV write of it (a retry is allowed only before the first write was posted);
/// - `transfer_off_route`: a routed prefill request wrote KV into another decode node than its
///   route names;
/// - `unrouted_transfer`: a prefill node that takes routes wrote KV for a request no route bound;
/// - `tenant_mismatch`: a node admitted a routed request for another tenant than the one the
///   router routed it for (the route's tenant binding, checked across the logs);
/// - `finished_not_on_decode`: the router saw the request finish; the decode node has no
///   `finished` row for the request it reserved under that route (in that incarnation).
///
/// A row missing because its node was killed is not a disagreement about what happened: each
/// row says, in `explained_by_crash`, when the node whose row is missing has an incarnation that
/// ended without a `stop` row (written at every clean shutdown) within a second after the event
/// — its writer had not written its last rows. Evidence of a violation (`retried_after_write`,
/// `transfer_off_route`, `unrouted_transfer`, `tenant_mismatch`) is never explained so.
pub fn fleet_crosscheck_sql() -> String {
    format!(
        r#"WITH {ROUTES_CTE},
starts AS (SELECT node_id, seq, wall_ns FROM all_node_events WHERE event = 'start'),
stops AS (SELECT node_id, seq FROM all_node_events WHERE event = 'stop'),
pwin AS (SELECT p.node_id, p.seq, p.transfer, p.prefill, p.decode, p.request,
                COALESCE(MIN(s.seq), 9223372036854775807) AS until_seq
           FROM pnode p LEFT JOIN starts s ON s.node_id = p.node_id AND s.seq > p.seq
          GROUP BY p.node_id, p.seq, p.transfer, p.prefill, p.decode, p.request),
dwin AS (SELECT d.node_id, d.seq, d.transfer, d.decode, d.request,
                COALESCE(MIN(s.seq), 9223372036854775807) AS until_seq
           FROM dnode d LEFT JOIN starts s ON s.node_id = d.node_id AND s.seq > d.seq
          GROUP BY d.node_id, d.seq, d.transfer, d.decode, d.request),
routed_prefills AS (SELECT DISTINCT node_id FROM pnode),
ptransfers AS (SELECT t.node_id, t.seq, t.request_id, t.dst_node FROM all_transfers t
                WHERE t.node_id IN (SELECT node_id FROM routed_prefills)
                  AND t.src_node = t.node_id),
-- The tenant each node admitted a routed request for: its latest `admitted` row of that request
-- id before the route row (prefill records the route right after admission, decode right after
-- reserving).
noderoutes AS (SELECT node_id, seq, transfer, request FROM pnode
               UNION ALL SELECT node_id, seq, transfer, request FROM dnode),
nadm AS (SELECT n.transfer, n.node_id, MAX(q.seq) AS adm_seq
           FROM noderoutes n JOIN all_requests q
             ON q.node_id = n.node_id AND CAST(q.request_id AS VARCHAR) = n.request
            AND q.event = 'admitted' AND q.seq < n.seq
          GROUP BY n.transfer, n.node_id),
ntenant AS (SELECT a.transfer, a.node_id, q.tenant
              FROM nadm a JOIN all_requests q ON q.node_id = a.node_id AND q.seq = a.adm_seq),
dis AS (
SELECT 'admitted_without_prefill_record' AS kind, a.transfer, a.prefill AS node, a.prefill_request AS request,
       CONCAT('router node ', CAST(a.node_id AS VARCHAR), ' request ', a.request) AS detail,
       a.prefill AS missing_node, a.wall_ns AS t_wall
  FROM router a LEFT JOIN pnode p
    ON p.transfer = a.transfer AND p.prefill = a.prefill AND p.request = a.prefill_request
 WHERE a.outcome = 'admitted' AND p.transfer IS NULL
UNION ALL
SELECT 'admitted_without_decode_record', a.transfer, a.decode, a.prefill_request,
       CONCAT('router node ', CAST(a.node_id AS VARCHAR), ' request ', a.request), a.decode AS missing_node, a.wall_ns AS t_wall
  FROM router a LEFT JOIN dnode d ON d.transfer = a.transfer AND d.decode = a.decode
 WHERE a.outcome = 'admitted' AND d.transfer IS NULL
UNION ALL
SELECT 'prefill_route_not_minted', p.transfer, CAST(p.node_id AS VARCHAR), p.request, p.detail,
       regexp_match(p.detail, '(?:^| )router=([0-9]+)')[1] AS missing_node, p.wall_ns AS t_wall
  FROM pnode p LEFT JOIN chosen c
    ON c.transfer = p.transfer AND c.prefill = p.prefill AND c.decode = p.decode AND c.epoch = p.epoch
 WHERE c.transfer IS NULL
UNION ALL
SELECT 'decode_route_not_minted', d.transfer, CAST(d.node_id AS VARCHAR), d.request, d.detail,
       regexp_match(d.detail, '(?:^| )router=([0-9]+)')[1] AS missing_node, d.wall_ns AS t_wall
  FROM dnode d LEFT JOIN chosen c
    ON c.transfer = d.transfer AND c.prefill = d.prefill AND c.decode = d.decode AND c.epoch = d.epoch
 WHERE c.transfer IS NULL
UNION ALL
SELECT 'decode_route_without_prefill', d.transfer, CAST(d.node_id AS VARCHAR), d.request, d.detail,
       d.prefill AS missing_node, d.wall_ns AS t_wall
  FROM dnode d LEFT JOIN pnode p ON p.transfer = d.transfer
 WHERE p.transfer IS NULL
UNION ALL
SELECT DISTINCT 'retried_after_write', r.transfer, p.prefill, p.request,
       CONCAT('router request ', r.request, ' retried; prefill node ', p.prefill, ' recorded a KV write of it'),
       CAST(NULL AS VARCHAR) AS missing_node, CAST(NULL AS BIGINT) AS t_wall
  FROM router r JOIN pwin p ON p.transfer = r.transfer
  JOIN ptransfers t ON t.node_id = p.node_id AND CAST(t.request_id AS VARCHAR) = p.request
                   AND t.seq > p.seq AND t.seq < p.until_seq
 WHERE r.outcome = 'retry'
UNION ALL
SELECT DISTINCT 'transfer_off_route', p.transfer, CAST(t.node_id AS VARCHAR), CAST(t.request_id AS VARCHAR),
       CONCAT('wrote into decode node ', CAST(t.dst_node AS VARCHAR), ', the route names ', p.decode),
       CAST(NULL AS VARCHAR) AS missing_node, CAST(NULL AS BIGINT) AS t_wall
  FROM ptransfers t JOIN pwin p
    ON t.node_id = p.node_id AND CAST(t.request_id AS VARCHAR) = p.request
   AND t.seq > p.seq AND t.seq < p.until_seq
 WHERE CAST(t.dst_node AS VARCHAR) <> p.decode
UNION ALL
SELECT DISTINCT 'unrouted_transfer', CAST(NULL AS VARCHAR) AS transfer, CAST(t.node_id AS VARCHAR), CAST(t.request_id AS VARCHAR),
       CONCAT('wrote into decode node ', CAST(t.dst_node AS VARCHAR), ' under no route'),
       CAST(NULL AS VARCHAR) AS missing_node, CAST(NULL AS BIGINT) AS t_wall
  FROM ptransfers t LEFT JOIN pwin p
    ON t.node_id = p.node_id AND CAST(t.request_id AS VARCHAR) = p.request
   AND t.seq > p.seq AND t.seq < p.until_seq
 WHERE p.transfer IS NULL
UNION ALL
SELECT DISTINCT 'tenant_mismatch', c.transfer, CAST(t.node_id AS VARCHAR), CAST(NULL AS VARCHAR) AS request,
       CONCAT('the router routed it for tenant ', regexp_match(c.detail, '(?:^| )tenant="([^"]*)"')[1],
              ', node ', CAST(t.node_id AS VARCHAR), ' admitted it for ', t.tenant),
       CAST(NULL AS VARCHAR) AS missing_node, CAST(NULL AS BIGINT) AS t_wall
  FROM chosen c JOIN ntenant t ON t.transfer = c.transfer
 WHERE regexp_match(c.detail, '(?:^| )tenant="([^"]*)"')[1] <> t.tenant
UNION ALL
SELECT 'finished_not_on_decode', f.transfer, d.decode, d.request,
       CONCAT('router request ', f.request, ' finished; decode request ', d.request, ' has no finished row'),
       d.decode AS missing_node, f.wall_ns AS t_wall
  FROM router f JOIN dwin d ON d.transfer = f.transfer
  LEFT JOIN (SELECT node_id, request_id, seq FROM all_requests WHERE event = 'finished') q
    ON q.node_id = d.node_id AND CAST(q.request_id AS VARCHAR) = d.request
   AND q.seq > d.seq AND q.seq < d.until_seq
 WHERE f.outcome = 'finished' AND q.request_id IS NULL
),
inc AS (SELECT s.node_id, s.seq AS start_seq, s.wall_ns AS start_wall,
               COALESCE(MIN(n.seq), 9223372036854775807) AS until_seq
          FROM starts s LEFT JOIN starts n ON n.node_id = s.node_id AND n.seq > s.seq
         GROUP BY s.node_id, s.seq, s.wall_ns),
rows_all AS (SELECT node_id, seq, wall_ns FROM all_requests
             UNION ALL SELECT node_id, seq, wall_ns FROM all_node_events
             UNION ALL SELECT node_id, seq, wall_ns FROM all_page_events),
tails AS (SELECT i.node_id, i.start_seq, i.start_wall, i.until_seq, MAX(r.wall_ns) AS last_wall
            FROM inc i JOIN rows_all r ON r.node_id = i.node_id AND r.seq >= i.start_seq AND r.seq < i.until_seq
           GROUP BY i.node_id, i.start_seq, i.start_wall, i.until_seq),
clean AS (SELECT DISTINCT i.node_id, i.start_seq FROM inc i JOIN stops st
            ON st.node_id = i.node_id AND st.seq > i.start_seq AND st.seq < i.until_seq),
crashed AS (SELECT t.node_id, t.start_wall, t.last_wall FROM tails t
              LEFT JOIN clean c ON c.node_id = t.node_id AND c.start_seq = t.start_seq
             WHERE c.node_id IS NULL)
SELECT DISTINCT d.kind, d.transfer, d.node, d.request, d.detail,
       CASE WHEN k.node_id IS NULL THEN '' ELSE CONCAT(
         'node ', CAST(k.node_id AS VARCHAR), ' was killed: its log (no stop row) ends ',
         CAST((k.last_wall - d.t_wall) / 1000000 AS VARCHAR),
         ' ms from this event (negative: before it); the missing row was in its unwritten tail')
       END AS explained_by_crash
  FROM dis d LEFT JOIN crashed k
    ON CAST(k.node_id AS VARCHAR) = d.missing_node AND k.start_wall <= d.t_wall
   AND k.last_wall < d.t_wall + {CRASH_TAIL_NS}
ORDER BY kind, transfer, node, request, detail, explained_by_crash"#
    )
}

/// How long before a killed incarnation's last written row an event may be whose row that
/// node lost with its unwritten tail (its writer flushes every 50 ms; a second covers a loaded
/// machine and clocks a little apart).
const CRASH_TAIL_NS: i64 = 1_000_000_000;

/// What the fleet crosscheck compared: route rows by node role and the router's outcomes.
pub fn fleet_counts_sql() -> String {
    format!(
        r#"WITH {ROUTES_CTE}
SELECT 'router' AS side, outcome, COUNT(*) AS rows FROM router GROUP BY outcome
UNION ALL SELECT 'prefill', NULL, COUNT(*) FROM pnode
UNION ALL SELECT 'decode', NULL, COUNT(*) FROM dnode
ORDER BY side, outcome"#
    )
}

/// The path of request `{request}` of node `{node}` across the fleet: every route row (router,
/// prefill, decode; every attempt of the router's request) that shares a transfer id with it or
/// belongs to the same router request.
pub fn fleet_path_sql(node: u32, request: u64) -> String {
    format!(
        r#"WITH {ROUTES_CTE},
mine AS (SELECT DISTINCT transfer FROM routes
          WHERE node_id = {node} AND request = '{request}' AND outcome IS NULL),
rreq AS (SELECT DISTINCT r.node_id, r.request FROM router r JOIN mine m ON r.transfer = m.transfer),
attempts AS (SELECT DISTINCT r.transfer FROM router r JOIN rreq q
               ON r.node_id = q.node_id AND r.request = q.request WHERE r.transfer IS NOT NULL)
SELECT CASE WHEN x.outcome IS NOT NULL THEN 'router'
            WHEN CAST(x.node_id AS VARCHAR) = x.prefill THEN 'prefill' ELSE 'decode' END AS role,
       x.node_id, x.request, x.transfer, x.outcome, x.wall_ns, x.detail
  FROM routes x
 WHERE x.transfer IN (SELECT transfer FROM attempts)
    OR (x.outcome IS NOT NULL AND EXISTS (SELECT 1 FROM rreq q WHERE q.node_id = x.node_id AND q.request = x.request))
 ORDER BY x.wall_ns, role, x.node_id, x.seq"#
    )
}

/// The decode side of request `{request}` of prefill node `{node}` (the routes it was written
/// under): its node and request id, whose timelines follow.
pub fn fleet_decode_sides_sql(node: u32, request: u64) -> String {
    format!(
        r#"WITH {ROUTES_CTE}
SELECT DISTINCT CAST(d.node_id AS BIGINT) AS node, CAST(d.request AS BIGINT) AS request
  FROM pnode p JOIN dnode d ON d.transfer = p.transfer
 WHERE p.node_id = {node} AND p.request = '{request}'
 ORDER BY node, request"#
    )
}

/// Reads the tag check refused: exposures that did not happen.
pub const PREVENTED_SQL: &str = r#"
SELECT node_id, request_id, tenant, page, generation, kind, detail, wall_ns
FROM all_integrity_violations
WHERE wall_ns >= {from_ns} AND wall_ns < {to_ns}
ORDER BY node_id, seq
"#;

/// One affected response.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Affected {
    pub node: u32,
    pub request: u64,
    pub recipient_tenant: String,
    /// (source tenant, slots of its data attended), by tenant.
    pub sources: Vec<(String, u64)>,
    pub foreign_slots: u64,
    /// When the response's earliest and latest foreign reads were recorded (wall ns).
    pub first_wall_ns: i64,
    pub last_wall_ns: i64,
    /// The node read these slots without the tag check (incident reproduction).
    pub unchecked: bool,
}

/// The exposure answer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Exposure {
    pub affected: Vec<Affected>,
    pub prevented: u64,
}

impl Exposure {
    pub fn affected_responses(&self) -> usize {
        self.affected.len()
    }
    pub fn source_tenants(&self) -> std::collections::BTreeSet<&str> {
        self.affected
            .iter()
            .flat_map(|a| a.sources.iter().map(|(t, _)| t.as_str()))
            .collect()
    }
    pub fn recipient_tenants(&self) -> std::collections::BTreeSet<&str> {
        self.affected
            .iter()
            .map(|a| a.recipient_tenant.as_str())
            .collect()
    }
    pub fn max_foreign_slots(&self) -> u64 {
        self.affected
            .iter()
            .map(|a| a.foreign_slots)
            .max()
            .unwrap_or(0)
    }
    /// The earliest and the latest foreign read of any affected response.
    pub fn first_last_wall_ns(&self) -> Option<(i64, i64)> {
        let first = self.affected.iter().map(|a| a.first_wall_ns).min()?;
        let last = self.affected.iter().map(|a| a.last_wall_ns).max()?;
        Some((first, last))
    }

    /// The summary a responder publishes.
    pub fn summary(&self) -> String {
        let (first, last) = self.first_last_wall_ns().unwrap_or((0, 0));
        format!(
            "affected responses: {}\ndistinct source tenants (whose data was exposed): {}\ndistinct recipient tenants (who received it): {}\nmax foreign slots in one reply: {}\nfirst occurrence (wall ns): {}\nlast occurrence (wall ns): {}\nprevented exposures (reads refused by the tag check): {}",
            self.affected_responses(),
            self.source_tenants().len(),
            self.recipient_tenants().len(),
            self.max_foreign_slots(),
            first,
            last,
            self.prevented
        )
    }
}

/// Fill a query template's time window.
pub fn with_window(sql: &str, from_ns: Option<i64>, to_ns: Option<i64>) -> String {
    sql.replace("{from_ns}", &from_ns.unwrap_or(i64::MIN).to_string())
        .replace("{to_ns}", &to_ns.unwrap_or(i64::MAX).to_string())
}

/// Run the exposure question over a session prepared by [`crate::prepare_forensics`].
pub async fn exposure(
    ctx: &SessionContext,
    from_ns: Option<i64>,
    to_ns: Option<i64>,
) -> Result<Exposure, QueryError> {
    Ok(exposure_with_rows(ctx, from_ns, to_ns).await?.0)
}

/// [`exposure`], and the rows of [`EXPOSURE_SQL`] it was built from (for a caller that prints
/// them: the query runs once).
pub async fn exposure_with_rows(
    ctx: &SessionContext,
    from_ns: Option<i64>,
    to_ns: Option<i64>,
) -> Result<(Exposure, Vec<RecordBatch>), QueryError> {
    prepare_exposure(ctx, from_ns, to_ns).await?;
    let batches = tuned(ctx)?
        .sql(&with_window(EXPOSURE_SQL, from_ns, to_ns))
        .await?
        .collect()
        .await?;
    drop_exposure_tables(ctx).await?;
    let mut out: Vec<Affected> = Vec::new();
    for b in &batches {
        let node = b.column(0).as_primitive::<UInt32Type>();
        let req = b.column(1).as_primitive::<UInt64Type>();
        let rt = b.column(2).as_string::<i32>();
        let st = b.column(3).as_string::<i32>();
        let n = b.column(4).as_primitive::<Int64Type>();
        let wall = b.column(5).as_primitive::<Int64Type>();
        let unchecked = b.column(6).as_primitive::<Int64Type>();
        let last_wall = b.column(7).as_primitive::<Int64Type>();
        for i in 0..b.num_rows() {
            let (nd, rq) = (node.value(i), req.value(i));
            let slots = n.value(i) as u64;
            match out.last_mut() {
                Some(a) if a.node == nd && a.request == rq && a.recipient_tenant == rt.value(i) => {
                    a.sources.push((st.value(i).to_owned(), slots));
                    a.foreign_slots += slots;
                    a.first_wall_ns = a.first_wall_ns.min(wall.value(i));
                    a.last_wall_ns = a.last_wall_ns.max(last_wall.value(i));
                    a.unchecked |= unchecked.value(i) != 0;
                }
                _ => out.push(Affected {
                    node: nd,
                    request: rq,
                    recipient_tenant: rt.value(i).to_owned(),
                    sources: vec![(st.value(i).to_owned(), slots)],
                    foreign_slots: slots,
                    first_wall_ns: wall.value(i),
                    last_wall_ns: last_wall.value(i),
                    unchecked: unchecked.value(i) != 0,
                }),
            }
        }
    }
    let prevented = ctx
        .sql(&with_window(PREVENTED_SQL, from_ns, to_ns))
        .await?
        .collect()
        .await?
        .iter()
        .map(|b| b.num_rows() as u64)
        .sum();
    Ok((
        Exposure {
            affected: out,
            prevented,
        },
        batches,
    ))
}

/// What `custody forensics notify` builds its notices from: the exposure answer per writing
/// request ([`EXPOSURE_SOURCES_SQL`]), every tenant with a request in the window, the window
/// (the log's first and last request when not given) and the nodes that served them.
pub async fn notice_inputs(
    ctx: &SessionContext,
    from_ns: Option<i64>,
    to_ns: Option<i64>,
) -> Result<
    (
        Vec<custody_audit::notice::SourcedExposure>,
        custody_audit::notice::NoticeScope,
    ),
    QueryError,
> {
    use custody_audit::notice::{NoticeScope, SourcedExposure};
    prepare_exposure(ctx, from_ns, to_ns).await?;
    let batches = tuned(ctx)?
        .sql(&with_window(EXPOSURE_SOURCES_SQL, from_ns, to_ns))
        .await?
        .collect()
        .await?;
    drop_exposure_tables(ctx).await?;
    let mut rows = Vec::new();
    for b in &batches {
        let node = b.column(0).as_primitive::<UInt32Type>();
        let req = b.column(1).as_primitive::<UInt64Type>();
        let rt = b.column(2).as_string::<i32>();
        let st = b.column(3).as_string::<i32>();
        let sreq = b.column(4).as_primitive::<UInt64Type>();
        let n = b.column(5).as_primitive::<Int64Type>();
        let wall = b.column(6).as_primitive::<Int64Type>();
        let unchecked = b.column(7).as_primitive::<Int64Type>();
        let last_wall = b.column(8).as_primitive::<Int64Type>();
        for i in 0..b.num_rows() {
            rows.push(SourcedExposure {
                node: node.value(i),
                request: req.value(i),
                recipient_tenant: rt.value(i).to_owned(),
                source_tenant: st.value(i).to_owned(),
                source_request: sreq.value(i),
                foreign_slots: n.value(i) as u64,
                first_wall_ns: wall.value(i),
                last_wall_ns: last_wall.value(i),
                unchecked: unchecked.value(i) != 0,
            });
        }
    }
    let seen = ctx
        .sql(&with_window(
            "SELECT tenant, node_id, MIN(wall_ns) AS first, MAX(wall_ns) AS last FROM all_requests \
             WHERE tenant IS NOT NULL AND wall_ns >= {from_ns} AND wall_ns < {to_ns} \
             GROUP BY tenant, node_id",
            from_ns,
            to_ns,
        ))
        .await?
        .collect()
        .await?;
    let mut scope = NoticeScope {
        tenants: Default::default(),
        from_wall_ns: from_ns.unwrap_or(i64::MAX),
        to_wall_ns: to_ns.unwrap_or(i64::MIN),
        nodes: Vec::new(),
    };
    for b in &seen {
        let t = b.column(0).as_string::<i32>();
        let node = b.column(1).as_primitive::<UInt32Type>();
        let first = b.column(2).as_primitive::<Int64Type>();
        let last = b.column(3).as_primitive::<Int64Type>();
        for i in 0..b.num_rows() {
            scope.tenants.insert(t.value(i).to_owned());
            if !scope.nodes.contains(&node.value(i)) {
                scope.nodes.push(node.value(i));
            }
            if from_ns.is_none() {
                scope.from_wall_ns = scope.from_wall_ns.min(first.value(i));
            }
            if to_ns.is_none() {
                scope.to_wall_ns = scope.to_wall_ns.max(last.value(i) + 1);
            }
        }
    }
    scope.nodes.sort_unstable();
    Ok((rows, scope))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn affected(request: u64, first_wall_ns: i64, last_wall_ns: i64) -> Affected {
        Affected {
            node: 1,
            request,
            recipient_tenant: "victim".into(),
            sources: vec![("owner".into(), 3)],
            foreign_slots: 3,
            first_wall_ns,
            last_wall_ns,
            unchecked: false,
        }
    }

    /// The exposure answer is ordered by its whole group key (the tenant question strips that
    /// very clause).
    #[test]
    fn exposure_order_is_its_group_key() {
        assert!(EXPOSURE_SQL.trim_end().ends_with(EXPOSURE_ORDER));
        assert!(EXPOSURE_SQL.contains("GROUP BY node_id, request_id, tenant, source_tenant"));
        assert!(!tenant_sql("acme", None, None).contains(EXPOSURE_ORDER));
    }

    /// The summary's last occurrence is the latest foreign read of any response — not the
    /// latest response's earliest one (response 1 here starts first and reads foreign data
    /// last).
    #[test]
    fn summary_spans_the_earliest_to_the_latest_foreign_read() {
        let e = Exposure {
            affected: vec![affected(1, 10, 50), affected(2, 20, 30)],
            prevented: 0,
        };
        assert_eq!(e.first_last_wall_ns(), Some((10, 50)));
        let s = e.summary();
        assert!(s.contains("first occurrence (wall ns): 10\n"), "{s}");
        assert!(s.contains("last occurrence (wall ns): 50\n"), "{s}");
    }
}
