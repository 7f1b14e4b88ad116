//! Custody's forensic SQL on an Apache DataFusion Ballista cluster.
//!
//! - [`connect`]: a session whose queries a Ballista scheduler plans and its executors run. The
//!   caller ([`custody_query::open_session_in`]) verifies the digest chain *in this process* first
//!   and registers only the verified files, by explicit URL; the cluster never lists the audit
//!   root. Tables this process would hold in memory go to a scratch location
//!   ([`custody_query::distributed`]).
//! - [`run_scheduler`], [`run_executor`]: the cluster's processes (`custody cluster scheduler`,
//!   `custody cluster executor`), Ballista's own scheduler and executor with the object stores
//!   Custody reads: local files and `s3://` with the same environment and bounded retries as
//!   `custody query`.
//!
//! Architecture invariant: Ballista is linked here and nowhere else; `custody-query` knows only
//! that a session may be distributed, never by what.

mod engine;
mod store;

use std::collections::HashMap;
use std::fmt;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ballista_core::extension::{
    SessionConfigExt, SessionStateExt, ballista_aggregate_functions, ballista_scalar_functions,
    ballista_window_functions,
};
use ballista_executor::executor_process::{ExecutorProcessConfig, start_executor_process};
use ballista_scheduler::cluster::BallistaCluster;
use ballista_scheduler::config::SchedulerConfig;
use custody_query::datafusion;
use custody_query::distributed::Distributed;
use datafusion::execution::object_store::ObjectStoreRegistry;
use datafusion::execution::runtime_env::{RuntimeEnv, RuntimeEnvBuilder};
use datafusion::execution::{SessionState, SessionStateBuilder};
use datafusion::prelude::{SessionConfig, SessionContext};
use object_store::ObjectStore;
use url::Url;

/// The scheduler's default port (Ballista's).
pub const SCHEDULER_PORT: u16 = 50050;
/// How long [`connect`] waits for the scheduler's port before saying it is unreachable.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("cluster URL {0}: expected df://HOST[:PORT]")]
    BadUrl(String),
    #[error("cannot reach the Ballista scheduler at {url}: {why}")]
    Unreachable { url: String, why: String },
    #[error(transparent)]
    DataFusion(#[from] datafusion::error::DataFusionError),
    #[error("ballista: {0}")]
    Ballista(#[from] ballista_core::error::BallistaError),
    #[error("address {addr}: {why}")]
    Address { addr: String, why: String },
}

/// A scheduler's address as a user names it: `df://HOST[:PORT]` (port default 50050).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SchedulerUrl {
    pub host: String,
    pub port: u16,
}

impl SchedulerUrl {
    pub fn parse(s: &str) -> Result<Self, ClusterError> {
        let bad = || ClusterError::BadUrl(s.to_owned());
        if !s.starts_with("df://") {
            return Err(bad());
        }
        let url = Url::parse(s).map_err(|_| bad())?;
        let host = url.host_str().filter(|h| !h.is_empty()).ok_or_else(bad)?;
        if !url.path().trim_matches('/').is_empty() || url.query().is_some() {
            return Err(bad());
        }
        Ok(Self {
            host: host.to_owned(),
            port: url.port().unwrap_or(SCHEDULER_PORT),
        })
    }

    /// The gRPC endpoint Ballista's client connects to.
    fn endpoint(&self) -> String {
        format!("http://{}:{}", self.host, self.port)
    }
}

impl std::str::FromStr for SchedulerUrl {
    type Err = ClusterError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl fmt::Display for SchedulerUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "df://{}:{}", self.host, self.port)
    }
}

/// A session planned by the scheduler at `url` and run by its executors, with `distributed`'s
/// scratch location for what it materialises. Fails with [`ClusterError::Unreachable`] when
/// nothing answers on the scheduler's port (within 5 s), before any verification work.
pub async fn connect(
    url: &SchedulerUrl,
    distributed: Distributed,
) -> Result<SessionContext, ClusterError> {
    let addr = format!("{}:{}", url.host, url.port);
    match tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::TcpStream::connect(&addr)).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => {
            return Err(ClusterError::Unreachable {
                url: url.to_string(),
                why: e.to_string(),
            });
        }
        Err(_) => {
            return Err(ClusterError::Unreachable {
                url: url.to_string(),
                why: format!("no answer within {} s", CONNECT_TIMEOUT.as_secs()),
            });
        }
    }
    // Ballista 55's adaptive planner loses track of stages on the forensic queries (the
    // scheduler refuses the finished tasks' outputs — "Can't find active stage" — and the job
    // never ends); the static planner plans each job once, before it runs.
    const ADAPTIVE: &str = ballista_core::config::BALLISTA_ADAPTIVE_PLANNER_ENABLED;
    // Dynamic filters (TopK, join and aggregate bounds pushed into scans at run time) are shared
    // state of one process's plan; a Ballista task runs a plan cut down to its partitions, where
    // a join's bounds would come from part of its build side. Off: the cluster runs the plan as
    // planned.
    const DYNAMIC_FILTERS: &str = "datafusion.optimizer.enable_dynamic_filter_pushdown";
    let distributed = distributed.pin(ADAPTIVE).pin(DYNAMIC_FILTERS);
    let config = SessionConfig::new_with_ballista()
        .with_information_schema(true)
        .set_bool(ADAPTIVE, false)
        .set_bool(DYNAMIC_FILTERS, false)
        .with_extension(Arc::new(distributed));
    let state = SessionStateBuilder::new()
        .with_config(config)
        .with_runtime_env(runtime_env(&RuntimeEnvBuilder::new())?)
        .with_default_features()
        .build()
        .upgrade_for_ballista(url.endpoint())?;
    Ok(SessionContext::new_with_state(state))
}

/// The object stores a cluster process opens by URL: local files, and `s3://BUCKET` through
/// [`custody_query::source::s3_store`] (endpoint and credentials from the process's environment:
/// never shipped in a plan), one client per bucket — each behind [`store::NamedOnly`]: objects
/// by name, no listing.
#[derive(Debug)]
struct EnvObjectStores {
    local: Arc<dyn ObjectStore>,
    s3: Mutex<HashMap<String, Arc<dyn ObjectStore>>>,
}

impl Default for EnvObjectStores {
    fn default() -> Self {
        Self {
            local: store::NamedOnly::wrap(Arc::new(object_store::local::LocalFileSystem::new())),
            s3: Mutex::default(),
        }
    }
}

impl ObjectStoreRegistry for EnvObjectStores {
    fn register_store(
        &self,
        url: &Url,
        store: Arc<dyn ObjectStore>,
    ) -> Option<Arc<dyn ObjectStore>> {
        let bucket = url.host_str()?.to_owned();
        self.s3
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(bucket, store::NamedOnly::wrap(store))
    }

    fn get_store(&self, url: &Url) -> datafusion::error::Result<Arc<dyn ObjectStore>> {
        match url.scheme() {
            "" | "file" => Ok(self.local.clone()),
            "s3" => {
                let bucket = url.host_str().unwrap_or_default();
                let mut s3 = self.s3.lock().unwrap_or_else(|e| e.into_inner());
                if let Some(store) = s3.get(bucket) {
                    return Ok(store.clone());
                }
                let store = custody_query::source::s3_store(bucket)
                    .map_err(|e| datafusion::error::DataFusionError::External(Box::new(e)))?;
                let store = store::NamedOnly::wrap(store);
                s3.insert(bucket.to_owned(), store.clone());
                Ok(store)
            }
            other => Err(datafusion::error::DataFusionError::Configuration(format!(
                "{url}: no object store for {other}:// on this cluster (file and s3 only)"
            ))),
        }
    }
}

fn runtime_env(builder: &RuntimeEnvBuilder) -> datafusion::error::Result<Arc<RuntimeEnv>> {
    Ok(Arc::new(
        builder
            .clone()
            .with_object_store_registry(Arc::new(EnvObjectStores::default()))
            .build()?,
    ))
}

/// The scheduler's session for planning a job: Ballista's defaults, with [`EnvObjectStores`]
/// (the scheduler lists each explicit file — one HEAD per URL — to plan the scan).
fn scheduler_session(config: SessionConfig) -> datafusion::error::Result<SessionState> {
    Ok(SessionStateBuilder::new()
        .with_default_features()
        .with_config(config)
        .with_runtime_env(runtime_env(&RuntimeEnvBuilder::new())?)
        .with_optimizer_rules(ballista_core::optimizer::ballista_default_optimizer_rules())
        .with_scalar_functions(ballista_scalar_functions())
        .with_aggregate_functions(ballista_aggregate_functions())
        .with_window_functions(ballista_window_functions())
        .build())
}

/// The functions an executor decodes plans with: Ballista's default registry lacks the nested
/// (array) functions its client and scheduler plan with — `range`, which the exposure SQL
/// unnests into slots, among them — so a stage using one fails to decode on the executor.
fn function_registry() -> ballista_core::registry::BallistaFunctionRegistry {
    let mut registry = ballista_core::registry::BallistaFunctionRegistry::default();
    for f in ballista_scalar_functions() {
        registry.scalar_functions.insert(f.name().to_owned(), f);
    }
    for f in ballista_aggregate_functions() {
        registry.aggregate_functions.insert(f.name().to_owned(), f);
    }
    for f in ballista_window_functions() {
        registry.window_functions.insert(f.name().to_owned(), f);
    }
    registry
}

/// `host:port` as a socket address (`host` a name or an IP literal, IPv6 with or without
/// brackets).
async fn socket_addr(host: &str, port: u16) -> Result<SocketAddr, ClusterError> {
    let bad = |why: String| ClusterError::Address {
        addr: format!("{host}:{port}"),
        why,
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    tokio::net::lookup_host((host, port))
        .await
        .map_err(|e| bad(e.to_string()))?
        .next()
        .ok_or_else(|| bad("resolves to no address".to_owned()))
}

/// `custody cluster scheduler`.
#[derive(Clone, Debug)]
pub struct SchedulerOptions {
    pub bind_host: String,
    pub port: u16,
    /// The host executors and clients are told to reach this scheduler at.
    pub external_host: String,
    /// An executor without a heartbeat for this long is declared lost and its tasks rescheduled.
    pub executor_timeout_s: u64,
}

/// The IP of `addr` as Ballista's `format!("{host}:{port}")` needs it (IPv6 in brackets).
fn ip_literal(addr: SocketAddr) -> String {
    match addr {
        SocketAddr::V4(a) => a.ip().to_string(),
        SocketAddr::V6(a) => format!("[{}]", a.ip()),
    }
}

/// Run a scheduler until the process is stopped.
pub async fn run_scheduler(opts: SchedulerOptions) -> Result<(), ClusterError> {
    let addr = socket_addr(&opts.bind_host, opts.port).await?;
    let config = SchedulerConfig {
        bind_host: ip_literal(addr),
        bind_port: opts.port,
        external_host: opts.external_host.clone(),
        executor_timeout_seconds: opts.executor_timeout_s,
        // Checked at a third of the timeout: a lost executor is noticed within 4/3 of it.
        expire_dead_executor_interval_seconds: (opts.executor_timeout_s / 3).max(1),
        no_executors_grace_period_seconds: opts.executor_timeout_s,
        ..SchedulerConfig::default()
    }
    .with_override_session_builder(Arc::new(scheduler_session));
    let cluster = BallistaCluster::new_from_config(&config).await?;
    tracing::info!(%addr, "ballista scheduler listening");
    ballista_scheduler::scheduler_process::start_server(cluster, addr, Arc::new(config)).await?;
    Ok(())
}

/// `custody cluster executor`: its three ports must differ from every other executor's on the
/// same host.
#[derive(Clone, Debug)]
pub struct ExecutorOptions {
    pub bind_host: String,
    /// The host the scheduler and other executors reach this one at (default: `bind_host`).
    pub external_host: Option<String>,
    /// Arrow Flight (shuffle data served to other executors and the client).
    pub flight_port: u16,
    /// The executor's gRPC service (tasks pushed by the scheduler).
    pub grpc_port: u16,
    /// `/healthz` and `/readyz` (plain HTTP).
    pub health_port: u16,
    pub scheduler: SchedulerUrl,
    /// Tasks run at once (default: the machine's cores).
    pub vcores: Option<usize>,
    /// Where shuffle files are written (default: a temporary directory).
    pub work_dir: Option<String>,
    /// Seconds between heartbeats to the scheduler (less than its executor timeout).
    pub heartbeat_s: u64,
}

/// Run an executor until the process is stopped.
pub async fn run_executor(opts: ExecutorOptions) -> Result<(), ClusterError> {
    let health_addr = socket_addr(&opts.bind_host, opts.health_port).await?;
    let mut config = ExecutorProcessConfig {
        // Ballista formats `host:port` and parses it as a socket address: an IP literal.
        bind_host: ip_literal(health_addr),
        external_host: Some(
            opts.external_host
                .clone()
                .unwrap_or_else(|| opts.bind_host.clone()),
        ),
        port: opts.flight_port,
        grpc_port: opts.grpc_port,
        scheduler_host: opts.scheduler.host.clone(),
        scheduler_port: opts.scheduler.port,
        scheduler_connect_timeout_seconds: 10,
        work_dir: opts.work_dir.clone(),
        executor_heartbeat_interval_seconds: opts.heartbeat_s,
        ..ExecutorProcessConfig::default()
    };
    if let Some(v) = opts.vcores {
        config.vcores = v;
    }
    config.override_execution_engine = Some(Arc::new(engine::WithoutOperatorMetrics::default()));
    config.override_function_registry = Some(Arc::new(function_registry()));
    let work_dir = opts.work_dir.clone();
    config.override_runtime_producer = Some(Arc::new(move |_: &SessionConfig| {
        let mut b = RuntimeEnvBuilder::new();
        if let Some(d) = &work_dir {
            b = b.with_temp_file_path(d.clone());
        }
        runtime_env(&b)
    }));
    let (stop_health, health_stopped) = tokio::sync::oneshot::channel();
    let health = ballista_executor::health::spawn_health_server(
        health_addr,
        config.health.clone(),
        health_stopped,
    );
    tracing::info!(
        flight = opts.flight_port,
        grpc = opts.grpc_port,
        health = opts.health_port,
        scheduler = %opts.scheduler,
        "ballista executor starting"
    );
    let result = start_executor_process(Arc::new(config)).await;
    let _ = stop_health.send(());
    let _ = health.await;
    Ok(result?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scheduler_urls_parse_with_the_default_port() {
        assert_eq!(
            SchedulerUrl::parse("df://127.0.0.1:50070").expect("url"),
            SchedulerUrl {
                host: "127.0.0.1".into(),
                port: 50070
            }
        );
        let u = SchedulerUrl::parse("df://scheduler.internal").expect("url");
        assert_eq!(u.port, SCHEDULER_PORT);
        assert_eq!(u.to_string(), "df://scheduler.internal:50050");
        for bad in [
            "http://x:50050",
            "df://",
            "df://x:50050/path",
            "x:50050",
            "df://x:99999",
        ] {
            let e = SchedulerUrl::parse(bad).expect_err(bad);
            assert!(e.to_string().contains(bad), "{e}");
        }
    }
}
