//! A list schedule of one operation graph on in-order lanes.
//!
//! Every lane (a CUDA stream, a copy engine, the update worker, the host thread) runs its
//! operations in the order they were added, one at a time, so an operation starts at
//! `f(v) - d_v = max(finish of its dependencies, finish of the lane's previous operation)`.
//! Operations added after a host operation also wait for it: the host thread issues everything
//! in program order, and a host operation that waits (for a version, a ring slot) delays all
//! that it issues after. The operation that determined each start is kept, so the critical
//! path and the cause of every idle gap can be read back. A kind of lane may have several
//! units (each rank's update worker: [`Dag::add_on`]), each in order on its own.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

/// Where an operation runs; the names are the trace's lanes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Lane {
    Host,
    H2d,
    Compute,
    D2h,
    Update,
    Offload,
    /// The gradient's reduction across ranks and nodes (NCCL on its own stream).
    Reduce,
    /// Context parallelism's all-to-all over heads inside a layer (the compute waits for it).
    AllToAll,
}

#[derive(Clone, Debug)]
pub struct Op {
    pub name: String,
    pub lane: Lane,
    /// Which of the lane's units runs it (0 where the lane has one).
    pub unit: usize,
    pub duration_s: f64,
    pub start_s: f64,
    pub finish_s: f64,
    /// The operation whose finish set this one's start (`None`: it started at time 0).
    pub bound_by: Option<usize>,
}

#[derive(Default)]
pub struct Dag {
    pub ops: Vec<Op>,
    last_on_lane: HashMap<(Lane, usize), usize>,
    last_host: Option<usize>,
}

impl Dag {
    /// Add `name` on `lane`, lasting `duration_s`, after `deps` (and after the lane's previous
    /// operation and the host's latest); returns its index.
    pub fn add(
        &mut self,
        name: impl Into<String>,
        lane: Lane,
        duration_s: f64,
        deps: &[usize],
    ) -> usize {
        self.add_on(name, (lane, 0), duration_s, deps)
    }

    /// [`Dag::add`] on unit `unit` of `lane`: after that unit's previous operation only.
    pub fn add_on(
        &mut self,
        name: impl Into<String>,
        (lane, unit): (Lane, usize),
        duration_s: f64,
        deps: &[usize],
    ) -> usize {
        let mut preds: Vec<usize> = deps.to_vec();
        preds.extend(self.last_on_lane.get(&(lane, unit)).copied());
        if lane != Lane::Host {
            preds.extend(self.last_host);
        }
        let bound_by = preds
            .iter()
            .copied()
            .max_by(|a, b| self.ops[*a].finish_s.total_cmp(&self.ops[*b].finish_s));
        let start_s = bound_by.map_or(0.0, |p| self.ops[p].finish_s);
        let index = self.ops.len();
        self.ops.push(Op {
            name: name.into(),
            lane,
            unit,
            duration_s,
            start_s,
            finish_s: start_s + duration_s,
            bound_by,
        });
        self.last_on_lane.insert((lane, unit), index);
        if lane == Lane::Host {
            self.last_host = Some(index);
        }
        index
    }

    pub fn finish(&self, op: usize) -> f64 {
        self.ops[op].finish_s
    }

    /// The chain of operations that set `op`'s finish, first to last.
    pub fn critical_path(&self, op: usize) -> Vec<usize> {
        let mut path = vec![op];
        let mut at = op;
        while let Some(p) = self.ops[at].bound_by {
            path.push(p);
            at = p;
        }
        path.reverse();
        path
    }

    /// What `op` waited for in an idle gap of its lane that began at `since_s`: the chain that
    /// set its start, walked back to the gap's beginning, each operation on it charged with
    /// the part of the gap it ran in (host waits do no work and are charged nothing).
    pub fn gap_causes(&self, op: usize, since_s: f64) -> Vec<(Lane, f64)> {
        let mut causes = Vec::new();
        let mut until = self.ops[op].start_s;
        let mut at = self.ops[op].bound_by;
        while let Some(p) = at {
            let o = &self.ops[p];
            if o.finish_s <= since_s || until <= since_s {
                break;
            }
            let ran = o.finish_s.min(until) - o.start_s.max(since_s);
            if ran > 0.0 && o.duration_s > 0.0 {
                causes.push((o.lane, ran));
            }
            until = until.min(o.start_s);
            at = o.bound_by;
        }
        causes
    }
}
