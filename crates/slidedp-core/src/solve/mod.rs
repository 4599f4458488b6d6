//! The policy solver's integer program (paper §3.6, Algorithm 1, step "solve"): how many decoder
//! layers get each activation candidate, and how many keep their weights resident on the GPU,
//! to minimise the step time under the GPU memory budget.
//!
//! Variables: `n_j` layers of candidate `j` (integer), `y_j` whether `j` is used (binary), the
//! prefetch pool `P` and the backward transient `H` (the largest over the used candidates), `r`
//! resident layers (integer) and the step time `T`:
//!
//! ```text
//! min T
//!   Σ n_j = L,  n_j ≤ L·y_j,  P ≥ 2·o_j·y_j,  H ≥ h_j·y_j,  r ≤ R
//!   Σ n_j·m_j + P + H + r·w ≤ B,  H + G + r·w ≤ B (G: a clipped step's parked gradients)
//!   Σ n_j·o_j ≤ A (host memory: the offloaded shares, pinned from forward to backward)
//!   compute C = c0 + Σ n_j·τ_j + g·r;  forward F = Σ n_j·φ_j;  host U = u·(L − r)
//!   T ≥ C + E and T ≥ F + U + b·r + E (the update overlaps the backward, never the forward),
//!   or T ≥ C − g·r + max(U + E, g·r) (clipping: both updates after the backward, together)
//! ```
//!
//! Without clipping the streamed layers are the last `L − r`, so their gradients come first in
//! the backward; the gradient ring (a few chunks) lets the backward run only that far ahead
//! of the host update, so where the lane is slower than those layers' backward the resident
//! layers' backward starts when the lane ends: `b·r`, with `b` the least backward (replay
//! included, `time_s − forward_s`) of any candidate, a lower bound of theirs.
//!
//! `g` is a resident layer's update on the device (`Resident::update_s_per_layer`), on a stream
//! of its own: without clipping it shares the GPU's memory bandwidth with the backward's end
//! and the next forward, so it is compute time; with clipping it runs beside the host lane,
//! after the backward, and the longer of the two ends the step.
//!
//! `E` is the update of what is not a decoder layer (embedding, final norm, head): its
//! gradient is the backward's last, so its update ends every step.
//!
//! Layers of several kinds (`kinds`: Gemma 4's sliding and full attention, Qwen3.5's linear and
//! full attention) each take their own candidates: `Σ n_j = L_k` over kind `k`'s candidates,
//! `n_j ≤ L_k·y_j`. Memory, pool and transient rows are the same sums and maxima over every used
//! candidate; the host lane is `U = Σ_k u_k·L_k − u_min·r` (see `HostLane`). Without `kinds`,
//! one kind holds every layer and every candidate: the program above.
//!
//! The prefetch pool holds two consecutive offloaded shares during a backward (the one in use
//! and the next one, prefetched), bounded here by twice the largest used share. Solved with
//! `good_lp`'s pure-Rust `microlp` backend (no C library), memory rows in units of `B` (raw bytes
//! beside seconds made its simplex basis singular). The step-time model checks and ranks what
//! comes out; this program is the search.

use good_lp::{
    Expression, ProblemVariables, ResolutionError, Solution, SolverModel, Variable, constraint,
    microlp, variable,
};
use serde::{Deserialize, Serialize};

use crate::{Error, Result};

const GIB: f64 = (1u64 << 30) as f64;

/// One activation candidate of a decoder layer, as measured by the layer profiler.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Candidate {
    pub name: String,
    /// Its forward + backward (replay included, copies overlapped) in the engine, seconds.
    pub time_s: f64,
    /// Its forward alone, seconds: the host lane has nothing to update before the backward.
    #[serde(default)]
    pub forward_s: f64,
    /// Device bytes kept from its forward to its backward.
    pub retained_bytes: f64,
    /// Bytes moved to host memory and back (the prefetch pool holds two such shares).
    #[serde(default)]
    pub offloaded_bytes: f64,
    /// The largest transient of its backward.
    #[serde(default)]
    pub transient_bytes: f64,
    /// Its kind of layer: an index into `Problem::kinds` (0 without kinds).
    #[serde(default)]
    pub kind: usize,
}

/// A kind of decoder layer (same class and parameter shapes): how many layers are of it and
/// their host update each.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Kind {
    pub name: String,
    pub layers: u32,
    /// Seconds per streamed layer of this kind; the host lane's `update_s_per_layer` if absent.
    #[serde(default)]
    pub update_s_per_layer: Option<f64>,
}

/// The host update lane: AdamW and its copies, per streamed (non-resident) layer. With kinds, a
/// resident layer takes the cheapest kind's update off the lane: resident layers are the first
/// ones in layer order, whatever their kind, and that saving holds for any of them.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostLane {
    pub update_s_per_layer: f64,
    /// With gradient clipping the update waits for the global norm: it follows the backward.
    pub serial: bool,
    /// The update of the embedding and head (never resident), after the backward's end.
    #[serde(default)]
    pub tail_s: f64,
}

/// GPU-resident layers: bytes each one keeps on the device (BF16 weights, FP32 master and Adam
/// moments when updated there) and how many may be resident. With kinds, the largest kind's
/// bytes: the first `r` layers in layer order, of whatever kinds, fit in `r` times it.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Resident {
    pub bytes_per_layer: f64,
    pub max_layers: u32,
    /// The device update of one resident layer (its AdamW pass), seconds: `g` of the program
    /// (module docs). With kinds, the largest kind's.
    #[serde(default)]
    pub update_s_per_layer: f64,
}

/// The program, as Python builds it (`slidedp.autopolicy.program`). It and its parts refuse
/// unknown fields: a field misnamed on either side of the JSON seam is an error, not a default.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Problem {
    pub layers: u32,
    /// Device bytes for activations (and resident layers): the GPU's total less everything the
    /// layout does not change (window, head, allocator reserve).
    pub budget_bytes: f64,
    pub candidates: Vec<Candidate>,
    /// Step time outside the layers' compute (embedding, head, waits), seconds.
    #[serde(default)]
    pub fixed_s: f64,
    /// Device bytes that take the activations' place at the end of a clipped backward (the
    /// parked gradients): with the transient they must fit the budget too.
    #[serde(default)]
    pub parked_bytes: f64,
    #[serde(default)]
    pub host: Option<HostLane>,
    #[serde(default)]
    pub resident: Option<Resident>,
    /// The layers' kinds (their `layers` sum to `layers`); empty: one kind, every layer.
    #[serde(default)]
    pub kinds: Vec<Kind>,
    /// Host bytes the offloaded activations may pin (`A`: each layer's offloaded share stays in
    /// host memory from its forward to its backward); unbounded when absent.
    #[serde(default)]
    pub host_budget_bytes: Option<f64>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Layout {
    /// Layers per candidate, in the problem's order.
    pub counts: Vec<u32>,
    pub resident_layers: u32,
    pub step_s: f64,
    pub compute_s: f64,
    pub host_s: f64,
    pub memory_bytes: f64,
    /// Host bytes of the offloaded activations (`Σ n_j·o_j`).
    pub offloaded_bytes: f64,
}

impl Problem {
    fn check(&self) -> Result<()> {
        let bad = |what: String| Err(Error::InvalidArgument(what));
        if self.layers == 0 || self.candidates.is_empty() {
            return bad("a layout needs at least one layer and one candidate".into());
        }
        let finite = |x: f64| x.is_finite() && x >= 0.0;
        let host_budget = self.host_budget_bytes.unwrap_or(0.0);
        let (resident_bytes, resident_update_s) = self
            .resident
            .as_ref()
            .map_or((0.0, 0.0), |r| (r.bytes_per_layer, r.update_s_per_layer));
        if ![
            self.budget_bytes,
            self.fixed_s,
            self.parked_bytes,
            host_budget,
            resident_bytes,
            resident_update_s,
        ]
        .into_iter()
        .all(finite)
        {
            return bad(
                "budget_bytes, fixed_s, parked_bytes, host_budget_bytes and the resident \
                 bytes_per_layer and update_s_per_layer must be finite and >= 0"
                    .into(),
            );
        }
        for c in &self.candidates {
            let costs = [
                c.time_s,
                c.retained_bytes,
                c.offloaded_bytes,
                c.transient_bytes,
            ];
            if !costs.into_iter().all(finite) {
                return bad(format!(
                    "candidate '{}': costs must be finite and >= 0",
                    c.name
                ));
            }
        }
        self.check_kinds()
    }

    fn check_kinds(&self) -> Result<()> {
        let bad = |what: String| Err(Error::InvalidArgument(what));
        let kinds = self.kind_layers();
        if kinds.iter().sum::<u32>() != self.layers {
            return bad(format!(
                "the kinds' layers sum to {}, the problem has {}",
                kinds.iter().sum::<u32>(),
                self.layers
            ));
        }
        for c in &self.candidates {
            if c.kind >= kinds.len() {
                return bad(format!("candidate '{}': no kind {}", c.name, c.kind));
            }
        }
        for (k, kind) in self.kinds.iter().enumerate() {
            if !self.candidates.iter().any(|c| c.kind == k) {
                return bad(format!("kind '{}' has no candidate", kind.name));
            }
            if kind
                .update_s_per_layer
                .is_some_and(|u| !(u.is_finite() && u >= 0.0))
            {
                return bad(format!(
                    "kind '{}': update_s_per_layer must be >= 0",
                    kind.name
                ));
            }
        }
        Ok(())
    }

    /// Layers per kind (one kind of every layer without `kinds`).
    fn kind_layers(&self) -> Vec<u32> {
        if self.kinds.is_empty() {
            vec![self.layers]
        } else {
            self.kinds.iter().map(|k| k.layers).collect()
        }
    }

    /// The host lane of every layer streamed (`Σ_k u_k·L_k`, less `u_min·L`) and the update a
    /// resident layer saves (`u_min`): `U = fixed + u_min·(L − r)`.
    fn host_terms(&self, h: &HostLane) -> (f64, f64) {
        let per_kind: Vec<(f64, u32)> = if self.kinds.is_empty() {
            vec![(h.update_s_per_layer, self.layers)]
        } else {
            (self.kinds.iter())
                .map(|k| {
                    (
                        k.update_s_per_layer.unwrap_or(h.update_s_per_layer),
                        k.layers,
                    )
                })
                .collect()
        };
        let least = per_kind
            .iter()
            .map(|(u, _)| *u)
            .fold(f64::INFINITY, f64::min);
        let fixed = per_kind
            .iter()
            .map(|(u, n)| (u - least) * f64::from(*n))
            .sum();
        (fixed, least)
    }

    /// The least backward of a layer, replay included, over every candidate (≥ 0): what the
    /// resident layers' backward takes at least, after an overlapped host lane that paced the
    /// streamed layers' backward.
    fn least_backward_s(&self) -> f64 {
        (self.candidates.iter())
            .map(|c| (c.time_s - c.forward_s).max(0.0))
            .fold(f64::INFINITY, f64::min)
    }

    /// Bytes of `counts` with `resident` layers, as the program counts them.
    pub fn memory_bytes(&self, counts: &[u32], resident: u32) -> f64 {
        let used = || self.candidates.iter().zip(counts).filter(|(_, n)| **n > 0);
        let kept: f64 = used().map(|(c, n)| c.retained_bytes * f64::from(*n)).sum();
        let pool = used()
            .map(|(c, _)| 2.0 * c.offloaded_bytes)
            .fold(0.0, f64::max);
        let transient = used().map(|(c, _)| c.transient_bytes).fold(0.0, f64::max);
        let per_resident = self.resident.as_ref().map_or(0.0, |r| r.bytes_per_layer);
        kept + pool + transient + f64::from(resident) * per_resident
    }

    /// Host bytes of the activations `counts` offload.
    pub fn offloaded_bytes(&self, counts: &[u32]) -> f64 {
        (self.candidates.iter().zip(counts))
            .map(|(c, n)| c.offloaded_bytes * f64::from(*n))
            .sum()
    }
}

/// The fastest layout of `problem` that fits its budget.
pub fn solve(problem: &Problem) -> Result<Layout> {
    problem.check()?;
    let layers = f64::from(problem.layers);
    let mut vars = ProblemVariables::new();
    let n: Vec<Variable> = problem
        .candidates
        .iter()
        .map(|_| vars.add(variable().integer().min(0.0).max(layers)))
        .collect();
    let y: Vec<Variable> = n.iter().map(|_| vars.add(variable().binary())).collect();
    let pool = vars.add(variable().min(0.0));
    let transient = vars.add(variable().min(0.0));
    let (per_resident, max_resident, resident_update_s) =
        problem.resident.as_ref().map_or((0.0, 0.0, 0.0), |r| {
            (
                r.bytes_per_layer,
                f64::from(r.max_layers.min(problem.layers)),
                r.update_s_per_layer,
            )
        });
    let resident = vars.add(variable().integer().min(0.0).max(max_resident));
    let step = vars.add(variable().min(0.0));

    let cands = &problem.candidates;
    let kinds = problem.kind_layers();
    // memory rows in budgets: bytes (~1e10) beside seconds (~1e-2) make the simplex's basis
    // ill-conditioned ("Singular matrix" from microlp on real profiles)
    let unit = if problem.budget_bytes > 0.0 {
        problem.budget_bytes
    } else {
        1.0
    };
    let share = |bytes: f64| bytes / unit;
    // the layers' compute and the resident layers' device update
    let layers_compute: Expression = n
        .iter()
        .zip(cands)
        .map(|(v, c)| c.time_s * *v)
        .sum::<Expression>()
        + problem.fixed_s;
    let resident_update = resident_update_s * resident;
    let compute = layers_compute.clone() + resident_update.clone();
    let forward: Expression = n.iter().zip(cands).map(|(v, c)| c.forward_s * *v).sum();
    let memory: Expression = n
        .iter()
        .zip(cands)
        .map(|(v, c)| share(c.retained_bytes) * *v)
        .sum::<Expression>()
        + pool
        + transient
        + share(per_resident) * resident;
    // among equal steps (the host lane binds) the least compute: its weight is far below any
    // difference of whole layers' times
    let objective = step + 1e-6 * compute.clone();
    let mut model = vars.minimise(objective).using(microlp);
    for (k, &kind_layers) in kinds.iter().enumerate() {
        let of_kind = n.iter().zip(cands).filter(|(_, c)| c.kind == k);
        let total: Expression = of_kind.map(|(v, _)| *v).sum();
        model.add_constraint(constraint!(total == f64::from(kind_layers)));
    }
    for ((nj, yj), c) in n.iter().zip(&y).zip(cands) {
        model.add_constraint(constraint!(*nj <= f64::from(kinds[c.kind]) * *yj));
        model.add_constraint(constraint!(pool >= 2.0 * share(c.offloaded_bytes) * *yj));
        model.add_constraint(constraint!(transient >= share(c.transient_bytes) * *yj));
    }
    let budget = share(problem.budget_bytes);
    model.add_constraint(constraint!(memory <= budget));
    if let Some(limit) = problem.host_budget_bytes {
        // in units of the larger of the budget and the largest share, as the device rows in
        // theirs: every coefficient at most 1, also for a budget of 0 (nothing offloads)
        let unit = cands
            .iter()
            .map(|c| c.offloaded_bytes)
            .fold(limit, f64::max);
        if unit > 0.0 {
            let pinned: Expression = (n.iter().zip(cands))
                .map(|(v, c)| (c.offloaded_bytes / unit) * *v)
                .sum();
            model.add_constraint(constraint!(pinned <= limit / unit));
        }
    }
    // resident layers stay beside the parked gradients of a clipped step's end
    model.add_constraint(constraint!(
        transient + share(problem.parked_bytes) + share(per_resident) * resident <= budget
    ));
    match &problem.host {
        Some(h) => {
            let (fixed, least) = problem.host_terms(h);
            let host = least * (layers - resident) + fixed;
            if h.serial {
                model.add_constraint(constraint!(
                    step >= layers_compute.clone() + host + h.tail_s
                ));
                model.add_constraint(constraint!(step >= layers_compute + resident_update));
            } else {
                let paced = problem.least_backward_s() * resident;
                model.add_constraint(constraint!(step >= compute.clone() + h.tail_s));
                model.add_constraint(constraint!(step >= forward + host + paced + h.tail_s));
            }
        }
        None => {
            model.add_constraint(constraint!(step >= compute));
        }
    }
    let solution = model.solve().map_err(|e| match e {
        ResolutionError::Infeasible => Error::InvalidArgument(format!(
            "no layout of {} layers fits {:.2} GiB of device memory{}",
            problem.layers,
            problem.budget_bytes / GIB,
            problem.host_budget_bytes.map_or(String::new(), |a| format!(
                " and {:.2} GiB of host memory for offloaded activations",
                a / GIB
            ))
        )),
        // never the input's fault: name the solver, so it is not read as "does not fit"
        other => Error::InvalidArgument(format!("the layout solver failed: {other}")),
    })?;
    // integer variables come back as floats within the solver's tolerance
    let counts: Vec<u32> = n
        .iter()
        .map(|v| solution.value(*v).round() as u32)
        .collect();
    let resident_layers = solution.value(resident).round() as u32;
    let layout = layout_of(problem, counts, resident_layers);
    // the solver's tolerances must not have bent a constraint (a bug, never bad input)
    for (k, &kind_layers) in kinds.iter().enumerate() {
        let counts = layout.counts.iter().zip(cands).filter(|(_, c)| c.kind == k);
        assert_eq!(
            counts.map(|(n, _)| n).sum::<u32>(),
            kind_layers,
            "{layout:?}"
        );
    }
    assert!(
        layout.memory_bytes <= problem.budget_bytes * (1.0 + 1e-9),
        "{layout:?}"
    );
    let host_budget = problem.host_budget_bytes.unwrap_or(f64::INFINITY);
    assert!(
        layout.offloaded_bytes <= host_budget * (1.0 + 1e-9),
        "{layout:?}"
    );
    Ok(layout)
}

/// The program's own accounting of a layout (used for the solution and for comparisons).
pub fn layout_of(problem: &Problem, counts: Vec<u32>, resident_layers: u32) -> Layout {
    let resident_update_s = problem.resident.as_ref().map_or(0.0, |r| {
        r.update_s_per_layer * f64::from(resident_layers.min(problem.layers))
    });
    let layers_compute_s = problem.fixed_s
        + problem
            .candidates
            .iter()
            .zip(&counts)
            .map(|(c, n)| c.time_s * f64::from(*n))
            .sum::<f64>();
    let compute_s = layers_compute_s + resident_update_s;
    let forward_s: f64 = (problem.candidates.iter().zip(&counts))
        .map(|(c, n)| c.forward_s * f64::from(*n))
        .sum();
    let streamed = f64::from(problem.layers - resident_layers.min(problem.layers));
    let lane = |h: &HostLane| {
        let (fixed, least) = problem.host_terms(h);
        least * streamed + fixed
    };
    let (host_s, step_s) = match &problem.host {
        Some(h) if h.serial => (
            lane(h) + h.tail_s,
            layers_compute_s + (lane(h) + h.tail_s).max(resident_update_s),
        ),
        Some(h) => {
            let paced = problem.least_backward_s() * f64::from(resident_layers.min(problem.layers));
            (
                lane(h) + h.tail_s,
                compute_s.max(forward_s + lane(h) + paced) + h.tail_s,
            )
        }
        None => (0.0, compute_s),
    };
    let memory_bytes = problem.memory_bytes(&counts, resident_layers);
    let offloaded_bytes = problem.offloaded_bytes(&counts);
    Layout {
        counts,
        resident_layers,
        step_s,
        compute_s,
        host_s,
        memory_bytes,
        offloaded_bytes,
    }
}

#[cfg(test)]
mod tests;
