//! Reading the JSON logs of `fusec run --log-json`: one object per line, `{"step":S,"loss":x,
//! "lr":…,"tokens":N,"ms":…}` for each optimizer step (with `"val_loss"` when validation ran before
//! the step), and `{"step":N,"val_loss":x}` after the last one (`runtime/src/train.rs` writes
//! them). A malformed line is an error `file:line: what was expected`.

use std::path::Path;

use serde_json::{Map, Value};

/// The curves of one run. A point's step is the number of optimizer steps done before the loss
/// was measured (the record's `step`: a training loss is measured before its step's update).
#[derive(Debug, Default, Clone, PartialEq)]
pub struct RunLog {
    /// Training loss per step, by step.
    pub train: Vec<(u64, f64)>,
    /// Validation loss, by step.
    pub val: Vec<(u64, f64)>,
    /// Tokens per optimizer step, when the log records them (`tokens`).
    pub tokens_per_step: Option<u64>,
}

/// Reads a log; non-finite losses (written as `null`) are left out of the curves.
pub fn read_log(path: &Path) -> Result<RunLog, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: cannot read: {e}", path.display()))?;
    let mut log = RunLog::default();
    // The line that set tokens_per_step, for a message when another disagrees.
    let mut tokens_line = 0;
    let mut records = 0;
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let at = |what: String| format!("{}:{}: {what}", path.display(), i + 1);
        let value: Value = serde_json::from_str(line)
            .map_err(|e| at(format!("expected a JSON object such as {{\"step\":0,\"loss\":5.3}} (as fusec run --log-json writes): {e}")))?;
        let rec = value.as_object().ok_or_else(|| at(format!("expected a JSON object, found {value}")))?;
        let step = rec.get("step").and_then(Value::as_u64).ok_or_else(|| at("expected \"step\": a step number (0, 1, …)".into()))?;
        let loss = number(rec, "loss").map_err(at)?;
        let val = number(rec, "val_loss").map_err(at)?;
        if loss.is_none() && val.is_none() {
            return Err(at("expected \"loss\" or \"val_loss\" in the record".into()));
        }
        if let Some(Some(l)) = loss {
            log.train.push((step, l));
        }
        if let Some(Some(v)) = val {
            log.val.push((step, v));
        }
        if let Some(tokens) = rec.get("tokens") {
            let per = tokens
                .as_u64()
                .filter(|&n| n > 0 && n % (step + 1) == 0)
                .map(|n| n / (step + 1))
                .ok_or_else(|| at(format!("expected \"tokens\": a positive multiple of step + 1 = {}, found {tokens}", step + 1)))?;
            match log.tokens_per_step {
                Some(p) if p != per => {
                    return Err(at(format!("{per} tokens per step here, {p} on line {tokens_line}: one log must be one run")))
                }
                Some(_) => {}
                None => (log.tokens_per_step, tokens_line) = (Some(per), i + 1),
            }
        }
        records += 1;
    }
    if records == 0 {
        return Err(format!("{}: the log is empty: no step records (fusec run --log-json writes one per step)", path.display()));
    }
    log.train.sort_by_key(|p| p.0);
    log.val.sort_by_key(|p| p.0);
    Ok(log)
}

/// The number under `key`: `None` if absent, `Some(None)` if `null` (a non-finite loss).
fn number(rec: &Map<String, Value>, key: &str) -> Result<Option<Option<f64>>, String> {
    match rec.get(key) {
        None => Ok(None),
        Some(Value::Null) => Ok(Some(None)),
        Some(v) => v.as_f64().map(|x| Some(Some(x))).ok_or_else(|| format!("expected \"{key}\" to be a number, found {v}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(text: &str) -> Result<RunLog, String> {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let p = std::env::temp_dir().join(format!("fusec-plotlog-{}-{n}.jsonl", std::process::id()));
        std::fs::write(&p, text).unwrap();
        let r = read_log(&p);
        let _ = std::fs::remove_file(p);
        r
    }

    #[test]
    fn reads_steps_validation_and_tokens() {
        let log = read(concat!(
            "{\"step\":0,\"loss\":5.5,\"lr\":0.001,\"tokens\":256,\"ms\":3.1,\"val_loss\":5.6}\n",
            "{\"step\":1,\"loss\":null,\"lr\":0.001,\"tokens\":512,\"ms\":3.0}\n",
            "{\"step\":2,\"loss\":5.25,\"lr\":0.001,\"tokens\":768,\"ms\":3.0}\n",
            "\n{\"step\":3,\"val_loss\":5.0}\n"
        ))
        .unwrap();
        assert_eq!(log.train, [(0, 5.5), (2, 5.25)]);
        assert_eq!(log.val, [(0, 5.6), (3, 5.0)]);
        assert_eq!(log.tokens_per_step, Some(256));
    }

    #[test]
    fn bad_lines_name_the_line_and_what_was_expected() {
        for (text, want) in [
            ("{\"step\":0,\"loss\":5}\nnot json\n", ":2: expected a JSON object"),
            ("[1]\n", ":1: expected a JSON object, found [1]"),
            ("{\"loss\":5}\n", ":1: expected \"step\""),
            ("{\"step\":0,\"loss\":\"x\"}\n", ":1: expected \"loss\" to be a number"),
            ("{\"step\":0,\"lr\":1}\n", ":1: expected \"loss\" or \"val_loss\""),
            ("{\"step\":1,\"loss\":1,\"tokens\":3}\n", ":1: expected \"tokens\""),
            ("{\"step\":0,\"loss\":1,\"tokens\":4}\n{\"step\":1,\"loss\":1,\"tokens\":6}\n", ":2: 3 tokens per step here, 4 on line 1"),
            ("\n\n", "the log is empty"),
        ] {
            let e = read(text).unwrap_err();
            assert!(e.contains(want), "{text:?}: {e}");
        }
    }
}
