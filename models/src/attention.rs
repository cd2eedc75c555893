//! Causal attention alone, for kernel tests and benchmarks: [`bf16_attention_graph`],
//! [`f32_attention_graph`].

use fusec_ir::Graph;

/// `attention` and `attention_grad` on bf16 q/k/v (cast from the f32 inputs `qkv: [B, T, 3C]`
/// and `dout: [B, T, C]`), with `heads` heads of `d` columns and scale `1/sqrt(d)`; outputs
/// `out` and `dqkv` cast back to f32, and `lse` (f32 itself, `[B, heads, T]`).
pub fn bf16_attention_graph(heads: usize, d: usize) -> Graph {
    attention_graph(heads, d, true)
}

/// The same on f32 storage: `attention` and `attention_grad` read the inputs themselves.
pub fn f32_attention_graph(heads: usize, d: usize) -> Graph {
    attention_graph(heads, d, false)
}

fn attention_graph(heads: usize, d: usize, bf16: bool) -> Graph {
    let (c, c3, scale) = (heads * d, 3 * heads * d, 1.0 / (d as f64).sqrt());
    let attrs = format!("{{heads = {heads}, scale = {scale:?}}}");
    let body = if bf16 {
        format!(
            "  %2 = cast %0 : bf16[B, T, {c3}]
  %3, %4 = attention %2 {attrs} : bf16[B, T, {c}], f32[B, {heads}, T]
  %5 = cast %1 : bf16[B, T, {c}]
  %6 = attention_grad %2, %3, %4, %5 {attrs} : bf16[B, T, {c3}]
  %7 = cast %3 : f32[B, T, {c}]
  %8 = cast %6 : f32[B, T, {c3}]
  output \"out\" = %7
  output \"lse\" = %4
  output \"dqkv\" = %8"
        )
    } else {
        format!(
            "  %2, %3 = attention %0 {attrs} : f32[B, T, {c}], f32[B, {heads}, T]
  %4 = attention_grad %0, %2, %3, %1 {attrs} : f32[B, T, {c3}]
  output \"out\" = %2
  output \"lse\" = %3
  output \"dqkv\" = %4"
        )
    };
    let name = if bf16 { "bf16_attention" } else { "f32_attention" };
    let src = format!(
        "graph {name}(B, T) {{
  %0 = input \"qkv\" : f32[B, T, {c3}]
  %1 = input \"dout\" : f32[B, T, {c}]
{body}
}}
"
    );
    fusec_ir::text::parse(&src, &format!("{name}.graph")).unwrap_or_else(|e| panic!("{e}\n{src}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_attention_graph_parses_with_its_outputs() {
        let g = bf16_attention_graph(3, 32);
        let names: Vec<&str> = g.outputs.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["out", "lse", "dqkv"]);
    }
}
