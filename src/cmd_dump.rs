//! `fusec dump FILE --pass NAME`: the graph after a pass, as text.

use clap::Args;
use std::path::PathBuf;

use crate::{load_graph, CliResult};

/// Arguments of `fusec dump`.
#[derive(Args)]
pub struct DumpArgs {
    /// The `.graph` file.
    file: PathBuf,
    /// Print the graph after this pass (`parse` prints the canonical form of the input).
    #[arg(long, default_value = "parse")]
    pass: String,
}

/// Runs `fusec dump`.
pub fn dump(a: DumpArgs) -> CliResult {
    let g = load_graph(&a.file)?;
    match a.pass.as_str() {
        "parse" => {
            print!("{}", fusec_ir::text::print(&g));
            Ok(())
        }
        other => Err(format!("unknown pass `{other}`; known passes: parse")),
    }
}
