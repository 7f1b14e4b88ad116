//! The executor's execution engine: Ballista's own, without per-operator metrics.
//!
//! Why: Ballista 55's scheduler merges each task's operator metrics into its stage's by position
//! and refuses a task whose array is shorter — and a task's plan is cut down to its partitions,
//! where a `UnionExec` branch it does not read becomes an `EmptyExec`, which has no metrics. The
//! refused status update leaves the task running forever: the query hangs (seen here on the
//! forensic views, `sealed UNION ALL live`). A task that reports no operator metrics is
//! accepted as is. Everything else a task reports — its shuffle output, the runtime statistics
//! and window state later stages are planned and merged from, column statistics — is passed
//! through unchanged.

use std::fmt;
use std::sync::Arc;

use ballista_core::JobId;
use ballista_core::serde::protobuf::{
    RuntimeStatsReport, ShuffleWritePartition, TaskColumnStats, WindowStateReport,
};
use ballista_executor::execution_engine::{
    DefaultExecutionEngine, ExecutionEngine, QueryStageExecutor,
};
use custody_query::datafusion;
use datafusion::error::Result;
use datafusion::execution::context::TaskContext;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::metrics::MetricsSet;
use datafusion::prelude::SessionConfig;

/// [`DefaultExecutionEngine`] whose stages report no operator metrics.
#[derive(Default)]
pub(crate) struct WithoutOperatorMetrics {
    inner: DefaultExecutionEngine,
}

impl ExecutionEngine for WithoutOperatorMetrics {
    fn create_query_stage_exec(
        &self,
        job_id: JobId,
        stage_id: usize,
        task_id: usize,
        global_output_partition_ids: Vec<usize>,
        plan: Arc<dyn ExecutionPlan>,
        work_dir: &str,
        config: &SessionConfig,
    ) -> Result<Arc<dyn QueryStageExecutor>> {
        let inner = self.inner.create_query_stage_exec(
            job_id,
            stage_id,
            task_id,
            global_output_partition_ids,
            plan,
            work_dir,
            config,
        )?;
        Ok(Arc::new(StageWithoutMetrics(inner)))
    }
}

#[derive(Debug)]
struct StageWithoutMetrics(Arc<dyn QueryStageExecutor>);

impl fmt::Display for StageWithoutMetrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

#[async_trait::async_trait]
impl QueryStageExecutor for StageWithoutMetrics {
    async fn execute_query_stage(
        &self,
        task_id: usize,
        context: Arc<TaskContext>,
    ) -> Result<Vec<ShuffleWritePartition>> {
        self.0.execute_query_stage(task_id, context).await
    }

    fn collect_plan_metrics(&self) -> Vec<MetricsSet> {
        Vec::new()
    }

    fn collect_runtime_stats_reports(&self) -> Vec<RuntimeStatsReport> {
        self.0.collect_runtime_stats_reports()
    }

    fn collect_window_state_reports(&self) -> Result<Vec<WindowStateReport>> {
        self.0.collect_window_state_reports()
    }

    fn collect_column_stats(&self) -> Vec<TaskColumnStats> {
        self.0.collect_column_stats()
    }
}
