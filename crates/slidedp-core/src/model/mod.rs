//! The step-time model: a prediction of one steady-state training step from the service times
//! of its operations (paper §3.4, "Modeling Shared-Host Scaling").
//!
//! [`step::build`] lays out the engine's step as an operation graph over in-order lanes
//! ([`dag`]); [`predict`] schedules a few steps in a row and reads the last one: its period, each
//! lane's busy time, the compute lane's idle time by the lane that caused it (the trace's
//! exposed waits), the critical path into the step's end, and the regime. Service times come
//! from measurements (the layer profiler, the bench's lane times); the model adds the
//! dependencies: window slots, the gradient ring, version gates, the clipping schedule.

pub mod dag;
pub mod spec;
pub mod step;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

pub use dag::{Dag, Lane};
pub use spec::StepSpec;

/// Steps scheduled before the one read: the first fills the pipeline, the next reach the
/// steady state (updates of the previous step gating the loads of this one).
pub const WARM_STEPS: usize = 3;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Prediction {
    pub step_s: f64,
    /// Work per lane in one step, seconds (a lane of several units, the update workers of
    /// several owners: its busiest unit's).
    pub busy_s: BTreeMap<Lane, f64>,
    /// The compute lane's idle time in one step by the lane it waited for.
    pub exposed_s: BTreeMap<Lane, f64>,
    /// Operation names on the critical path into the step's end, within the step.
    pub critical_path: Vec<String>,
    /// "GPU-bound" when the compute lane is busy most of the step, else the lane it waits on.
    pub regime: String,
}

/// The prediction for `spec` (checked first: see [`StepSpec::check`]).
pub fn predict(spec: &StepSpec) -> crate::Result<Prediction> {
    spec.check()?;
    let steps = step::build(spec, WARM_STEPS + 1);
    let dag = &steps.dag;
    let last = steps.ends.len() - 1;
    let (first, end) = steps.spans[last];
    let (start_s, end_s) = (
        dag.finish(steps.ends[last - 1]),
        dag.finish(steps.ends[last]),
    );
    let mut busy_by_unit = BTreeMap::new();
    for op in &dag.ops[first..end] {
        *busy_by_unit.entry((op.lane, op.unit)).or_insert(0.0) += op.duration_s;
    }
    let mut busy_s = BTreeMap::new();
    for ((lane, _), seconds) in busy_by_unit {
        let busiest: &mut f64 = busy_s.entry(lane).or_insert(0.0);
        *busiest = busiest.max(seconds);
    }
    let mut exposed_s = BTreeMap::new();
    let mut previous: Option<f64> = None;
    for (i, op) in dag.ops.iter().enumerate() {
        if op.lane != Lane::Compute {
            continue;
        }
        if let Some(free) = previous {
            let gap = op.start_s - free;
            if i >= first && i < end && gap > 1e-12 {
                for (lane, seconds) in dag.gap_causes(i, free) {
                    *exposed_s.entry(lane).or_insert(0.0) += seconds;
                }
            }
        }
        previous = Some(op.finish_s);
    }
    let critical_path = dag
        .critical_path(steps.ends[last])
        .into_iter()
        .filter(|&i| dag.ops[i].finish_s > start_s)
        .map(|i| dag.ops[i].name.clone())
        .collect();
    let step_s = end_s - start_s;
    let compute = busy_s.get(&Lane::Compute).copied().unwrap_or(0.0);
    let regime = if compute >= 0.9 * step_s {
        format!(
            "GPU-bound (compute {:.0}% of the step)",
            100.0 * compute / step_s
        )
    } else {
        let (lane, wait) = exposed_s
            .iter()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map_or((Lane::Host, 0.0), |(l, w)| (*l, *w));
        format!("{lane:?}-bound: compute waits {:.0} ms for it", wait * 1e3)
    };
    Ok(Prediction {
        step_s,
        busy_s,
        exposed_s,
        critical_path,
        regime,
    })
}

#[cfg(test)]
mod tests;
