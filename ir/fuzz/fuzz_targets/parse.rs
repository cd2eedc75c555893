//! Fuzz target: the `.graph` parser must never panic, and whatever it accepts must round-trip
//! through the printer (`print(parse(print(g))) == print(g)`).
#![no_main]

use fusec_ir::text::{parse, print};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let src = String::from_utf8_lossy(data);
    match parse(&src, "fuzz") {
        Ok(g) => {
            let text = print(&g);
            let again = parse(&text, "fuzz").unwrap_or_else(|e| panic!("printed graph does not parse: {e}\n{text}"));
            assert_eq!(print(&again), text, "print(parse(print(g))) != print(g)");
        }
        Err(e) => {
            assert!(e.line >= 1 && e.col >= 1, "bad position {}:{}", e.line, e.col);
            assert!(e.line <= src.lines().count() + 1, "line {} past the end", e.line);
        }
    }
});
