//! The `.graph` files shipped in models/ are exactly what the builder produces today.

use fusec_models::{build_gpt2, Gpt2Config};

fn check(file: &str, preset: &str, name: &str) {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../models/").to_string() + file;
    let shipped = std::fs::read_to_string(&path).unwrap();
    let built = fusec_ir::text::print(&build_gpt2(&Gpt2Config::preset(preset).unwrap(), name));
    assert!(
        shipped == built,
        "{path} is out of date with the GPT-2 builder; regenerate it with `fusec export gpt2 --preset {preset} --name {name} -o models/{file}`"
    );
    let parsed = fusec_ir::text::parse(&shipped, &path).unwrap();
    assert_eq!(fusec_ir::text::print(&parsed), shipped);
}

#[test]
fn tiny_graph_is_up_to_date() {
    check("gpt2-tiny.graph", "tiny", "gpt2_tiny");
}

#[test]
fn gpt2_124m_graph_is_up_to_date() {
    check("gpt2-124m.graph", "d12", "gpt2_124m");
}
