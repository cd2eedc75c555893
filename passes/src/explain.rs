//! Why fusion candidates were refused: what `fusec dump --explain-fusion` prints.

use std::fmt;

/// One refused candidate.
#[derive(Clone, Debug, PartialEq)]
pub struct Refusal {
    /// The pass that considered it.
    pub pass: &'static str,
    /// Where: the value or node it would have fused, as printed (`%123`), and what it would
    /// have become (e.g. `layernorm`).
    pub at: String,
    /// The name of the legality predicate or cost rule that refused it (e.g. `axis-is-last`).
    pub rule: &'static str,
    /// What exactly did not hold.
    pub detail: String,
}

/// The refusals collected by the fusion passes, in the order they happened.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FusionLog {
    /// Every refusal.
    pub refusals: Vec<Refusal>,
}

impl FusionLog {
    /// Records a refusal.
    pub fn refuse(&mut self, pass: &'static str, at: impl Into<String>, rule: &'static str, detail: impl Into<String>) {
        self.refusals.push(Refusal { pass, at: at.into(), rule, detail: detail.into() });
    }

    /// The refusals of one pass.
    pub fn of(&self, pass: &str) -> Vec<&Refusal> {
        self.refusals.iter().filter(|r| r.pass == pass).collect()
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {} refused by `{}`: {}", self.pass, self.at, self.rule, self.detail)
    }
}
