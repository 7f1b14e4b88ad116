//! `custody cluster scheduler|executor`: the processes of an Apache DataFusion Ballista cluster
//! that `custody query|forensics … --cluster df://HOST:PORT` runs its SQL on.
//!
//! Ballista's services have no authentication here: whoever reaches the scheduler's port can run
//! SQL with the executors' file and S3 access. Both bind to 127.0.0.1 unless told otherwise; a
//! cluster across hosts belongs on a private network.

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use custody_cluster::{ExecutorOptions, SchedulerOptions, SchedulerUrl};

#[derive(Subcommand, Debug)]
pub(crate) enum ClusterCmd {
    /// A scheduler: plans each query into stages and hands their tasks to the executors
    Scheduler(SchedulerArgs),
    /// An executor: runs tasks, keeps their shuffle output and serves it (Arrow Flight)
    ///
    /// Each executor on one host needs its own three ports: `--port` (Flight), `--grpc-port`,
    /// `--health-port`. It reads the audit root and the scratch location by the URLs in the
    /// plan: a shared directory, or s3:// with AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID,
    /// AWS_SECRET_ACCESS_KEY, AWS_REGION, AWS_ALLOW_HTTP from its own environment.
    Executor(ExecutorArgs),
}

#[derive(Args, Debug)]
pub(crate) struct SchedulerArgs {
    #[arg(long, default_value = "127.0.0.1")]
    bind_host: String,
    #[arg(long, default_value_t = custody_cluster::SCHEDULER_PORT)]
    port: u16,
    /// The host name executors and clients use for this scheduler.
    #[arg(long, default_value = "localhost")]
    external_host: String,
    /// Seconds without a heartbeat after which an executor is declared lost (its tasks run
    /// again elsewhere); more than the executors' --heartbeat-s.
    #[arg(long, default_value_t = 30)]
    executor_timeout_s: u64,
}

#[derive(Args, Debug)]
pub(crate) struct ExecutorArgs {
    /// The scheduler: df://HOST[:PORT].
    #[arg(long, default_value = "df://localhost:50050")]
    scheduler: SchedulerUrl,
    #[arg(long, default_value = "127.0.0.1")]
    bind_host: String,
    /// The host name the scheduler and the other executors use for this one (default: the
    /// bind host; set it when binding 0.0.0.0).
    #[arg(long)]
    external_host: Option<String>,
    /// Arrow Flight port (shuffle data).
    #[arg(long, default_value_t = 50051)]
    port: u16,
    /// gRPC port (tasks from the scheduler).
    #[arg(long, default_value_t = 50052)]
    grpc_port: u16,
    /// Health port: /healthz (alive) and /readyz (registered with the scheduler).
    #[arg(long, default_value_t = 50053)]
    health_port: u16,
    /// Tasks run at once (default: this machine's cores).
    #[arg(long)]
    vcores: Option<usize>,
    /// Directory for shuffle files (default: a temporary directory).
    #[arg(long)]
    work_dir: Option<String>,
    /// Seconds between heartbeats to the scheduler.
    #[arg(long, default_value_t = 5)]
    heartbeat_s: u64,
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        // Ballista's binaries do the same: deep plans recurse when (de)serialised.
        .thread_stack_size(32 * 1024 * 1024)
        .build()
        .context("starting the async runtime")
}

pub(crate) fn cluster(c: ClusterCmd) -> Result<()> {
    match c {
        ClusterCmd::Scheduler(a) => {
            let opts = SchedulerOptions {
                bind_host: a.bind_host,
                port: a.port,
                external_host: a.external_host,
                executor_timeout_s: a.executor_timeout_s,
            };
            runtime()?
                .block_on(custody_cluster::run_scheduler(opts))
                .context("ballista scheduler")
        }
        ClusterCmd::Executor(a) => {
            anyhow::ensure!(a.heartbeat_s > 0, "--heartbeat-s must be at least 1 second");
            let opts = ExecutorOptions {
                bind_host: a.bind_host,
                external_host: a.external_host,
                flight_port: a.port,
                grpc_port: a.grpc_port,
                health_port: a.health_port,
                scheduler: a.scheduler,
                vcores: a.vcores,
                work_dir: a.work_dir,
                heartbeat_s: a.heartbeat_s,
            };
            runtime()?
                .block_on(custody_cluster::run_executor(opts))
                .context("ballista executor")
        }
    }
}
