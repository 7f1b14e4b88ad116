//! `custody query`, `custody forensics` and `custody report`: SQL over an audit root, a
//! directory or `s3://bucket/prefix` (verified files only, unless `--include-unverified`) — their
//! flags, the verified session and what it says of the root; the prompt and the printing of
//! results are `custody_query::repl`.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, Subcommand, ValueEnum};
use custody_query::datafusion::arrow::record_batch::RecordBatch;
use custody_query::datafusion::prelude::SessionContext;
use custody_query::{AuditRoot, forensics, repl};

#[derive(Clone, Copy, Debug, ValueEnum)]
pub(crate) enum Format {
    Table,
    Csv,
    Json,
}

impl From<Format> for repl::Format {
    fn from(f: Format) -> Self {
        match f {
            Format::Table => repl::Format::Table,
            Format::Csv => repl::Format::Csv,
            Format::Json => repl::Format::Json,
        }
    }
}

#[derive(Args, Debug)]
pub(crate) struct Source {
    /// Audit root: a directory, or `s3://bucket/prefix` (endpoint and credentials from
    /// AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION, AWS_ALLOW_HTTP).
    root: AuditRoot,
    /// Expected public key (hex file from `custody audit keygen`); default: trust the key in the
    /// first digest.
    #[arg(long)]
    public_key: Option<PathBuf>,
    /// Also read every sealed file that NO verified digest names (modified, planted, outside the
    /// chain): for looking at a damaged log. Results are not evidence.
    #[arg(long)]
    include_unverified: bool,
    #[arg(long, value_enum, default_value_t = Format::Table)]
    format: Format,
    /// Run the SQL on an Apache DataFusion Ballista cluster (`custody cluster`) instead of in
    /// this process: the digest chain is verified here first, and the cluster is handed only
    /// the verified files, each by name (never a directory to list).
    #[arg(long, value_name = "df://HOST:PORT")]
    cluster: Option<String>,
    /// With --cluster: where the cluster writes intermediate tables and this process the live
    /// segments' rows — a directory every executor can read and write, or s3://bucket/prefix
    /// (never inside the audit root). Default: <temp dir>/custody-scratch-<uid>, private to this
    /// user (executors on this host, as this user, only). Each command's directory in it is
    /// removed when the command ends.
    #[arg(long, requires = "cluster")]
    scratch: Option<AuditRoot>,
    /// With --cluster: give up (exit 1, a clear error) when the command has no answer after
    /// this many seconds. A Ballista 55 job that loses an executor while it runs can wait
    /// forever (docs/forensics.md, *On a cluster*).
    #[arg(long, requires = "cluster", default_value_t = 3600)]
    cluster_timeout_s: u64,
}

#[derive(Args, Debug)]
pub(crate) struct QueryArgs {
    #[command(flatten)]
    src: Source,
    /// Run this SQL and exit: one or more `;`-separated statements, `--` comments allowed
    /// (what `--show-sql` prints runs as printed).
    #[arg(short = 'c', long = "command", allow_hyphen_values = true)]
    command: Option<String>,
    /// Run the SQL in this file (statements as for `-c`) and exit.
    #[arg(short = 'f', long = "file")]
    file: Option<PathBuf>,
}

#[derive(Subcommand, Debug)]
pub(crate) enum ForensicsCmd {
    /// Every response that could have seen another tenant's data (see docs/forensics.md for the
    /// exact definition), per response and source tenant, then the summary; reads the tag check
    /// refused are counted as prevented exposures.
    Exposure {
        #[command(flatten)]
        src: Source,
        /// Print the SQL and exit (run it yourself with `custody query -c`).
        #[arg(long)]
        show_sql: bool,
        /// Only reads recorded at or after this UTC time (YYYY-MM-DD or YYYY-MM-DDTHH:MM:SSZ).
        #[arg(long)]
        from: Option<String>,
        /// Only reads recorded before this UTC time.
        #[arg(long)]
        to: Option<String>,
    },
    /// Per-tenant incident notices (docs/forensics.md, *Notices*): for every tenant with a
    /// request in the window, `<out>/<tenant>.notice.json` — what its responses could have read
    /// of other tenants' data and what other tenants' responses could have read of its own, each
    /// with the receipt of its own records, and every node's window consistency proof (a
    /// statement of non-exposure where nothing is listed) — and its signature
    /// `<tenant>.notice.sig` by `--key`; `<out>/notices.vkey` is the key tenants check it with
    /// (`custody receipt verify-notice`, `custody-verify notice`). A local root only.
    Notify {
        #[command(flatten)]
        src: Source,
        #[arg(long)]
        out: PathBuf,
        /// The notice key (`custody audit keygen`): the operator's, not a node's.
        #[arg(long)]
        key: PathBuf,
        /// The notice key's name in its signatures and verifier key.
        #[arg(long, default_value = "custody.invalid/notices")]
        name: String,
        /// Only reads recorded at or after this UTC time (YYYY-MM-DD or YYYY-MM-DDTHH:MM:SSZ).
        #[arg(long)]
        from: Option<String>,
        /// Only reads recorded before this UTC time.
        #[arg(long)]
        to: Option<String>,
    },
    /// Blast radius of one tenant: whose data it could have seen, and who could have seen its.
    Tenant {
        #[command(flatten)]
        src: Source,
        tenant: String,
        #[arg(long)]
        show_sql: bool,
    },
    /// Anomalies: prompts not fully transferred (prefill implausibly fast for the prompt), reads
    /// of pages with no write in their generation, transfers not completed, sequence gaps.
    Anomalies {
        #[command(flatten)]
        src: Source,
        #[arg(long)]
        show_sql: bool,
    },
    /// Prefix-cache hits by reader and writer tenant and scope: who attended pages another
    /// request computed (cross-tenant hits are legitimate only in an operator-declared public
    /// scope; any other is also in `exposure`).
    Cache {
        #[command(flatten)]
        src: Source,
        #[arg(long)]
        show_sql: bool,
    },
    /// The eBPF witness against the engine's record: every transfer the engine recorded has its
    /// observed writes (keys, offsets, lengths, wr_id); every observed write is in the record and
    /// landed in the page and generation the record says. Lists each discrepancy with both
    /// sides; exit code 1 when there is any (or when the witness reported lost events).
    Crosscheck {
        #[command(flatten)]
        src: Source,
        #[arg(long)]
        show_sql: bool,
    },
    /// A fleet's logs against each other: the router's routes (every decision, admission and
    /// end) against the prefill and decode nodes' records of the same transfer ids. Lists each
    /// disagreement; exit code 1 when there is any.
    Fleet {
        #[command(flatten)]
        src: Source,
        #[arg(long)]
        show_sql: bool,
    },
    /// The timeline of one request on one node: admission, pages and who wrote them, transfers,
    /// reads, violations, release; in a fleet, its path (the router's decisions and retries, the
    /// decode node it was written into) and the decode side's timeline.
    Request {
        #[command(flatten)]
        src: Source,
        /// Node id (request ids are per node).
        #[arg(long)]
        node: u32,
        request: u64,
        #[arg(long)]
        show_sql: bool,
    },
}

async fn session(src: &Source) -> Result<SessionContext> {
    Ok(verified_session(src).await?.ctx)
}

/// Open the verified part of the root, say what is read and what is excluded, and prepare the
/// forensic views.
async fn verified_session(src: &Source) -> Result<custody_query::VerifiedSession> {
    let key = match &src.public_key {
        Some(p) => Some(
            custody_audit::digest::read_verifying_key(p)
                .map_err(anyhow::Error::msg)
                .with_context(|| format!("reading public key {}", p.display()))?,
        ),
        None => None,
    };
    let cluster = cluster_session(src).await?;
    let on_cluster = cluster.is_some();
    let shown = crate::progress::Progress::spinner("verifying the digest chain");
    let vs = match cluster {
        Some(ctx) => {
            custody_query::open_session_in(
                ctx,
                &src.root,
                None,
                key.as_ref(),
                src.include_unverified,
            )
            .await
        }
        None => custody_query::open_session(&src.root, key.as_ref(), src.include_unverified).await,
    }
    .with_context(|| format!("opening audit root {}", src.root));
    shown.finish(0);
    let vs = vs?;
    let r = &vs.report;
    let key_note = if key.is_none() {
        " (key: the one in the first digest; pass --public-key to pin it)"
    } else {
        ""
    };
    let through = match (src.root.is_local(), on_cluster) {
        (true, false) => "",
        (false, false) => " (digests read and every object hashed through the object store)",
        (true, true) => " (handed to the cluster by name)",
        (false, true) => {
            " (digests read and every object hashed through the object store; handed to the cluster by name)"
        }
    };
    if vs.unverified_included {
        let unverified = r.parquet_files.len().saturating_sub(r.verified_files.len());
        let bar = format!("-- {}", "!".repeat(77));
        eprintln!("{bar}");
        eprintln!(
            "-- !!! --include-unverified: reading ALL {} sealed files under {}, including {unverified} \
             that did NOT verify against the digest chain{key_note}.",
            r.parquet_files.len(),
            src.root
        );
        eprintln!(
            "-- !!! UNVERIFIED DATA: results may include modified or planted rows and are NOT evidence."
        );
        eprintln!("{bar}");
    } else {
        eprintln!(
            "-- reading only files named by a verified digest chain: {} sealed files verified{through}{key_note}",
            r.verified_files.len(),
        );
    }
    if !r.problems.is_empty() {
        let fate = if vs.unverified_included {
            "INCLUDED anyway (--include-unverified)".to_owned()
        } else if src.root.is_local() {
            format!("EXCLUDED (run `custody audit verify {}`)", src.root)
        } else {
            "EXCLUDED".to_owned()
        };
        eprintln!(
            "-- WARNING: {} verification problems; the affected files are {fate}:",
            r.problems.len(),
        );
        for p in &r.problems {
            eprintln!("--   {p}");
        }
    }
    if !vs.report.live_segments.is_empty() {
        eprintln!(
            "-- note: {} unsealed live segment(s) are queryable as <table>_live and included in the forensic views (not yet covered by a digest)",
            vs.report.live_segments.len()
        );
    }
    custody_query::prepare_forensics(&vs.ctx).await?;
    Ok(vs)
}

/// A session on the Ballista cluster `--cluster` names, with its scratch directory; `None`
/// without `--cluster`.
#[cfg(feature = "cluster")]
async fn cluster_session(src: &Source) -> Result<Option<SessionContext>> {
    let Some(url) = &src.cluster else {
        return Ok(None);
    };
    let url = custody_cluster::SchedulerUrl::parse(url)?;
    let scratch = match &src.scratch {
        Some(s) => s.clone(),
        None => default_scratch()?,
    };
    let distributed = custody_query::distributed::Distributed::new(&scratch, &src.root, None)
        .context("the cluster's scratch location")?;
    eprintln!(
        "-- on the Ballista cluster at {url}; intermediate tables under {}",
        distributed.url()
    );
    Ok(Some(custody_cluster::connect(&url, distributed).await?))
}

/// `<temp dir>/custody-scratch-<uid>`: this user's own directory (mode 0700), so that no other
/// user can replace what the cluster writes there.
#[cfg(feature = "cluster")]
fn default_scratch() -> Result<AuditRoot> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
    let uid = std::fs::metadata("/proc/self")
        .context("this process's user id (/proc/self)")?
        .uid();
    let dir = std::env::temp_dir().join(format!("custody-scratch-{uid}"));
    match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e).with_context(|| format!("creating {}", dir.display())),
    }
    let m = std::fs::symlink_metadata(&dir).with_context(|| format!("{}", dir.display()))?;
    anyhow::ensure!(
        m.is_dir() && m.uid() == uid && m.permissions().mode() & 0o077 == 0,
        "{} is not a private directory of this user (a directory, owned by uid {uid}, mode 0700): pass --scratch",
        dir.display()
    );
    Ok(AuditRoot::Local(dir))
}

#[cfg(not(feature = "cluster"))]
async fn cluster_session(src: &Source) -> Result<Option<SessionContext>> {
    anyhow::ensure!(
        src.cluster.is_none(),
        "--cluster: this custody was built without the `cluster` feature"
    );
    Ok(None)
}

#[derive(Args, Debug)]
pub(crate) struct ReportArgs {
    /// Audit root: a directory or `s3://bucket/prefix` (as for `custody query`). The report reads
    /// only verified files: there is no `--include-unverified` here.
    root: AuditRoot,
    /// Expected public key (hex file from `custody audit keygen`); default: trust the key in the
    /// first digest.
    #[arg(long)]
    public_key: Option<PathBuf>,
    /// Only events recorded at or after this UTC time (YYYY-MM-DD or YYYY-MM-DDTHH:MM:SSZ).
    #[arg(long)]
    from: Option<String>,
    /// Only events recorded before this UTC time.
    #[arg(long)]
    to: Option<String>,
    /// Where to write the report (one self-contained HTML file).
    #[arg(short = 'o', long, default_value = "report.html")]
    out: PathBuf,
}

/// `custody report`: the compliance report as one self-contained HTML file.
pub(crate) fn report_cmd(a: ReportArgs, parse_utc: fn(&str) -> Result<i64>) -> Result<()> {
    let scope = custody_query::report::ReportScope {
        root: a.root.to_string(),
        from_ns: a.from.as_deref().map(parse_utc).transpose()?,
        to_ns: a.to.as_deref().map(parse_utc).transpose()?,
        generated_ns: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as i64),
    };
    let src = Source {
        root: a.root,
        public_key: a.public_key,
        include_unverified: false,
        format: Format::Table,
        cluster: None,
        scratch: None,
        cluster_timeout_s: 3600,
    };
    let html = runtime()?.block_on(async {
        let vs = verified_session(&src).await?;
        custody_query::report::render(&vs, &scope)
            .await
            .context("building the report")
    })?;
    // Write to a temporary name, then rename: a reader never sees half a report.
    let tmp = a.out.with_extension("html.tmp");
    std::fs::write(&tmp, html.as_bytes()).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, &a.out).with_context(|| format!("writing {}", a.out.display()))?;
    eprintln!(
        "report written to {} ({} KiB)",
        a.out.display(),
        html.len() / 1024
    );
    Ok(())
}

/// The spinner shown while a statement runs.
fn spinner() -> Box<dyn FnOnce()> {
    let shown = crate::progress::Progress::spinner("running the query");
    Box::new(move || shown.finish(0))
}

async fn run_sql(ctx: &SessionContext, sql: &str, format: Format) -> Result<()> {
    Ok(repl::run_and_print(ctx, sql, format.into(), &spinner).await?)
}

fn print(batches: &[RecordBatch], format: Format) -> Result<()> {
    Ok(repl::print(batches, format.into())?)
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")
}

/// Run a command's work; on a cluster, bounded by `--cluster-timeout-s`.
fn block_on<T>(src: &Source, work: impl std::future::Future<Output = Result<T>>) -> Result<T> {
    let rt = runtime()?;
    if src.cluster.is_none() {
        return rt.block_on(work);
    }
    let limit = std::time::Duration::from_secs(src.cluster_timeout_s);
    rt.block_on(async {
        match tokio::time::timeout(limit, work).await {
            Ok(r) => r,
            Err(_) => Err(anyhow::anyhow!(
                "no answer from the cluster within {} s (--cluster-timeout-s): a Ballista job that lost an executor while it ran can wait forever; check the executors and run the command again",
                limit.as_secs()
            )),
        }
    })
}

pub(crate) fn query(a: QueryArgs) -> Result<()> {
    if a.command.is_none() && a.file.is_none() {
        // The prompt: no bound on a session someone is typing into (Ctrl-C ends a statement).
        return runtime()?.block_on(async {
            let ctx = session(&a.src).await?;
            Ok(repl::interactive(&ctx, a.src.format.into(), &spinner).await?)
        });
    }
    block_on(&a.src, async {
        let ctx = session(&a.src).await?;
        if let Some(sql) = &a.command {
            return run_sql(&ctx, sql, a.src.format).await;
        }
        if let Some(f) = &a.file {
            let sql =
                std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?;
            return run_sql(&ctx, &sql, a.src.format).await;
        }
        Ok(())
    })
}

/// A request's timeline on its node and, in a fleet, its path and its decode side's timeline.
async fn request_across_fleet(src: &Source, node: u32, request: u64) -> Result<()> {
    use custody_query::datafusion::arrow::array::{Array, Int64Array};
    let ctx = forensics::tuned(&session(src).await?)?;
    println!("# request {request} on node {node}");
    run_sql(&ctx, &forensics::request_sql(node, request), src.format).await?;
    let path = custody_query::run_script(&ctx, &forensics::fleet_path_sql(node, request)).await?;
    if path.iter().flatten().all(|b| b.num_rows() == 0) {
        return Ok(());
    }
    println!("# its path across the fleet (router, prefill and decode route rows)");
    for b in &path {
        print(b, src.format)?;
    }
    let sides =
        custody_query::run_script(&ctx, &forensics::fleet_decode_sides_sql(node, request)).await?;
    for b in sides.iter().flatten() {
        let (Some(n), Some(r)) = (
            b.column(0).as_any().downcast_ref::<Int64Array>(),
            b.column(1).as_any().downcast_ref::<Int64Array>(),
        ) else {
            continue;
        };
        for i in 0..b.num_rows() {
            if n.is_null(i) || r.is_null(i) {
                continue;
            }
            let (dn, dr) = (n.value(i) as u32, r.value(i) as u64);
            println!("# decode side: request {dr} on node {dn}");
            run_sql(&ctx, &forensics::request_sql(dn, dr), src.format).await?;
        }
    }
    Ok(())
}

fn canned(src: &Source, sql: String, show_sql: bool) -> Result<()> {
    if show_sql {
        print!("{}", forensics::script(&sql));
        return Ok(());
    }
    block_on(src, async {
        let ctx = forensics::tuned(&session(src).await?)?;
        run_sql(&ctx, &sql, src.format).await
    })
}

pub(crate) fn forensics_cmd(c: ForensicsCmd, parse_utc: fn(&str) -> Result<i64>) -> Result<()> {
    match c {
        ForensicsCmd::Tenant {
            src,
            tenant,
            show_sql,
        } => canned(&src, forensics::tenant_sql(&tenant, None, None), show_sql),
        ForensicsCmd::Crosscheck { src, show_sql } => {
            if show_sql {
                println!(
                    "-- discrepancies between the engine's transfers and the witness's writes"
                );
                println!("{};", forensics::CROSSCHECK_SQL.trim());
                println!("-- what was compared");
                println!("{};", forensics::CROSSCHECK_COUNTS_SQL.trim());
                return Ok(());
            }
            let cc = block_on(&src, async {
                let ctx = session(&src).await?;
                println!("# discrepancies (engine side, witness side)");
                run_sql(&ctx, forensics::CROSSCHECK_SQL, src.format).await?;
                Ok::<_, anyhow::Error>(forensics::crosscheck(&ctx).await?)
            })?;
            println!("# summary\n{}", cc.summary());
            if cc.observed_writes == 0 && cc.engine_transfers > 0 {
                anyhow::bail!(
                    "the root has no witness observations (rdma_ops): run `custody probe` alongside the nodes"
                );
            }
            if !cc.clean() {
                anyhow::bail!(
                    "{} discrepancies between the engine's record and the witness ({} witness loss reports)",
                    cc.discrepancies.len(),
                    cc.witness_loss_reports
                );
            }
            Ok(())
        }
        ForensicsCmd::Anomalies { src, show_sql } => {
            canned(&src, forensics::ANOMALIES_SQL.to_owned(), show_sql)
        }
        ForensicsCmd::Cache { src, show_sql } => {
            canned(&src, forensics::CACHE_SQL.to_owned(), show_sql)
        }
        ForensicsCmd::Request {
            src,
            node,
            request,
            show_sql,
        } => {
            if show_sql {
                print!(
                    "{}",
                    forensics::script(&forensics::request_sql(node, request))
                );
                print!(
                    "{}",
                    forensics::script(&forensics::fleet_path_sql(node, request))
                );
                return Ok(());
            }
            block_on(&src, request_across_fleet(&src, node, request))
        }
        ForensicsCmd::Fleet { src, show_sql } => {
            if show_sql {
                println!("-- disagreements between the router's log and the nodes'");
                println!("{};", forensics::fleet_crosscheck_sql());
                println!("-- what was compared");
                println!("{};", forensics::fleet_counts_sql());
                return Ok(());
            }
            block_on(&src, async {
                let ctx = forensics::tuned(&session(&src).await?)?;
                println!("# disagreements (router vs prefill vs decode)");
                let rows =
                    custody_query::run_script(&ctx, &forensics::fleet_crosscheck_sql()).await?;
                let (unexplained, explained) = repl::count_unexplained(&rows)?;
                for b in &rows {
                    print(b, src.format)?;
                }
                println!("# what was compared");
                run_sql(&ctx, &forensics::fleet_counts_sql(), src.format).await?;
                if explained > 0 {
                    eprintln!(
                        "-- {explained} rows are missing from the logs of nodes that were killed (explained_by_crash)"
                    );
                }
                if unexplained > 0 {
                    anyhow::bail!("{unexplained} disagreements between the fleet's logs");
                }
                Ok(())
            })
        }
        ForensicsCmd::Notify {
            src,
            out,
            key,
            name,
            from,
            to,
        } => {
            let from_ns = from.as_deref().map(parse_utc).transpose()?;
            let to_ns = to.as_deref().map(parse_utc).transpose()?;
            notify(&src, &out, &key, &name, from_ns, to_ns)
        }
        ForensicsCmd::Exposure {
            src,
            show_sql,
            from,
            to,
        } => {
            let from_ns = from.as_deref().map(parse_utc).transpose()?;
            let to_ns = to.as_deref().map(parse_utc).transpose()?;
            if show_sql {
                print!("{}", forensics::exposure_script(from_ns, to_ns));
                return Ok(());
            }
            block_on(&src, async {
                let ctx = session(&src).await?;
                // The exposure query runs once: its rows are printed and summarised.
                let shown = crate::progress::Progress::spinner("running the exposure query");
                let exposure = forensics::exposure_with_rows(&ctx, from_ns, to_ns).await;
                shown.finish(0);
                let (e, rows) = exposure?;
                println!("# affected responses (one row per response and source tenant)");
                print(&rows, src.format)?;
                println!("# prevented exposures (reads refused by the tag check)");
                run_sql(
                    &ctx,
                    &forensics::with_window(forensics::PREVENTED_SQL, from_ns, to_ns),
                    src.format,
                )
                .await?;
                println!("# summary\n{}", e.summary());
                Ok(())
            })
        }
    }
}

/// `custody forensics notify`.
fn notify(
    src: &Source,
    out: &std::path::Path,
    key: &std::path::Path,
    name: &str,
    from_ns: Option<i64>,
    to_ns: Option<i64>,
) -> Result<()> {
    let custody_query::source::AuditRoot::Local(root) = &src.root else {
        anyhow::bail!(
            "custody forensics notify reads a local audit root (copy the bucket's first)"
        );
    };
    let signing = custody_audit::digest::read_signing_key(key)
        .map_err(anyhow::Error::msg)
        .with_context(|| format!("reading the notice key {}", key.display()))?;
    let signer = custody_audit::tlog::NoteSigner::new(name, signing)
        .with_context(|| format!("--name {name:?}"))?;
    let (rows, scope) = block_on(src, async {
        let ctx = session(src).await?;
        let shown = crate::progress::Progress::spinner("running the exposure query");
        let found = forensics::notice_inputs(&ctx, from_ns, to_ns).await;
        shown.finish(0);
        Ok(found?)
    })?;
    let store = custody_audit::digest::LocalStore::new(root);
    let issued = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as i64);
    let notices = custody_audit::notice::build_notices(&store, &rows, &scope, &signer, issued)?;
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let write = |file: String, bytes: &[u8]| {
        let p = out.join(file);
        std::fs::write(&p, bytes).with_context(|| format!("writing {}", p.display()))
    };
    write(
        "notices.vkey".into(),
        format!("{}\n", signer.vkey()).as_bytes(),
    )?;
    let mut exposed = 0;
    for n in &notices {
        write(format!("{}.notice.json", n.tenant), &n.json)?;
        write(format!("{}.notice.sig", n.tenant), &n.sig)?;
        exposed += usize::from(n.exposed);
        println!(
            "{}: {}",
            n.tenant,
            if n.exposed {
                "EXPOSED (notice)"
            } else {
                "not exposed (statement of non-exposure)"
            }
        );
    }
    println!(
        "{} notices in {} ({exposed} exposed, {} not), nodes {:?}, window {}..{} (wall ns); verifier key in notices.vkey",
        notices.len(),
        out.display(),
        notices.len() - exposed,
        scope.nodes,
        scope.from_wall_ns,
        scope.to_wall_ns
    );
    Ok(())
}
