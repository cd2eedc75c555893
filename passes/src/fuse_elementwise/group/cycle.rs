//! Why a closed group refuses a node: the paths that a merge would turn into a cycle.

use std::collections::HashSet;

use fusec_ir::ValueId;

use super::{State, NONE};
use crate::fuse_elementwise::Read;

impl State<'_, '_> {
    /// A member of group `gid` that does not feed node `n` through the group (a sink of the
    /// group that `n` does not read directly), if any.
    pub(super) fn member_not_feeding(&self, gid: u32, n: usize) -> Option<usize> {
        let cx = self.cx;
        let inputs = &cx.g.nodes[n].inputs;
        self.groups[gid as usize].members.iter().map(|&m| m as usize).find(|&m| {
            let results = &cx.g.nodes[m].results;
            let is_sink = results.iter().all(|r| cx.users[r.0 as usize].iter().all(|&u| self.group_of[u as usize] != gid));
            is_sink && !results.iter().any(|r| inputs.contains(r))
        })
    }

    /// Why the closed group `set.last()` refuses `n` (joining the other, open, groups of `set`):
    /// a path from it through outside nodes back into the merged group, or only closure.
    pub(super) fn cycle_detail(&self, set: &[u32], n: usize, reads: &[Read], k: usize, v: ValueId) -> String {
        let cx = self.cx;
        let gid = *set.last().expect("a candidate");
        // What the merged group would read from outside (open groups have no outside readers,
        // so only `gid` can be reached).
        let mut starts: Vec<ValueId> = reads.iter().map(|r| r.root).filter(|&r| !set.contains(&self.gof(r))).collect();
        for &h in &set[..set.len() - 1] {
            starts.extend(self.groups[h as usize].reads.iter().copied());
        }
        let (me, by, val) = (cx.node_name(n), cx.node_name(k), cx.at(v));
        if self.reaches(gid, starts) {
            format!(
                "merging {me} would create a cycle: the kernel's result {val} is read by {by} (`{}`) outside it, and {me} depends on that",
                cx.g.nodes[k].op.mnemonic()
            )
        } else {
            format!("the kernel is closed: its result {val} is already read by {by} outside it (kernels close once a result escapes, so a merge can neither form a cycle nor move the kernel after that reader)")
        }
    }

    /// Whether any of `starts` depends on group `gid` (through units outside it). A unit (group
    /// or unfused node) at or before the group's last member cannot, since closed groups never
    /// grow; the search skips those.
    fn reaches(&self, gid: u32, starts: Vec<ValueId>) -> bool {
        let cx = self.cx;
        let limit = self.groups[gid as usize].maxpos as usize;
        let mut seen: HashSet<(bool, usize)> = HashSet::new();
        let mut stack = starts;
        while let Some(v) = stack.pop() {
            let p = cx.prod(v);
            let h = self.group_of[p];
            if h == gid {
                return true;
            }
            let (unit, key) = if h == NONE { ((false, p), p) } else { ((true, h as usize), self.groups[h as usize].maxpos as usize) };
            if key <= limit || !seen.insert(unit) {
                continue;
            }
            if h == NONE {
                stack.extend(cx.reads(p).iter().map(|r| r.root));
            } else {
                for &m in &self.groups[h as usize].members {
                    stack.extend(cx.reads(m as usize).iter().map(|r| r.root).filter(|&r| self.gof(r) != h));
                }
            }
        }
        false
    }
}
