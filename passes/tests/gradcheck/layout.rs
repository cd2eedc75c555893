//! Gradient checks of the layout ops (reshape, broadcast, permute, slice, concat).

use super::*;

// ---- layout --------------------------------------------------------------------------------

#[test]
fn reshape() {
    let cases: Vec<(Shape, Shape)> = vec![
        (ls(&[2, 3, 4]), ls(&[6, 4])),
        (ls(&[4, 6]), ls(&[2, 2, 6])),
        (ls(&[12]), ls(&[3, 1, 4])),
        (ls(&[3, 4]), ls(&[12])),
        // Symbolic dims.
        (shp(&[sym("B"), lit(3), lit(4)]), shp(&[lit(3).mul(&sym("B")), lit(4)])),
        (shp(&[sym("B"), sym("T"), lit(2)]), shp(&[sym("B").mul(&sym("T")), lit(2)])),
        (shp(&[sym("B").mul(&sym("T")), lit(4)]), shp(&[sym("B"), sym("T"), lit(2), lit(2)])),
    ];
    for (k, (from, to)) in cases.into_iter().enumerate() {
        let mut c = Case::new(&format!("reshape_{k}"), 20 + k as u64);
        let x = c.param("x", from, Init::Normal(1.0));
        let y = c.op(Op::Reshape { shape: to }, &[x]);
        let z = c.op(Op::Unary(UnaryOp::Tanh), &[y]);
        gradcheck(&c.finish(z));
    }
}

#[test]
fn broadcast() {
    // (operand shape, dims, result shape)
    let cases: Vec<(Shape, Vec<usize>, Shape)> = vec![
        (ls(&[3]), vec![1], ls(&[2, 3])),                        // new leading axis
        (ls(&[3]), vec![0], ls(&[3, 2])),                        // new trailing axis
        (ls(&[3, 1]), vec![0, 1], ls(&[3, 4])),                  // size-1 operand dim
        (ls(&[1, 4]), vec![1, 2], ls(&[2, 3, 4])),               // new axis and size-1 dim
        (ls(&[2, 1, 3]), vec![0, 1, 2], ls(&[2, 5, 3])),         // size-1 in the middle
        (ls(&[1, 1]), vec![0, 2], ls(&[3, 2, 4])),               // all size-1 plus a new axis
        (ls(&[1, 3]), vec![0, 1], ls(&[1, 3, 4])),               // size-1 to size-1 (not reduced)
        (ls(&[2, 3]), vec![0, 1], ls(&[2, 3])),                  // identity
        (ls(&[]), vec![], ls(&[2, 3])),                          // scalar
        (ls(&[4]), vec![2], shp(&[sym("B"), sym("T"), lit(4)])), // symbolic new axes
        (ls(&[1, 4]), vec![0, 1], shp(&[sym("B"), lit(4)])),     // size-1 to symbolic
        (shp(&[sym("B"), lit(1)]), vec![0, 1], shp(&[sym("B"), lit(3)])),
    ];
    for (k, (from, dims, to)) in cases.into_iter().enumerate() {
        let mut c = Case::new(&format!("broadcast_{k}"), 40 + k as u64);
        let x = c.param("x", from, Init::Normal(1.0));
        let y = c.op(Op::Broadcast { dims, shape: to }, &[x]);
        // A nonlinearity after the broadcast so that the adjoint differs per repeated element.
        let z = c.op(Op::Unary(UnaryOp::Tanh), &[y]);
        gradcheck(&c.finish(z));
    }
}

#[test]
fn permute() {
    let cases: Vec<(Vec<u64>, Vec<usize>)> = vec![
        (vec![2, 3, 4], vec![2, 0, 1]),
        (vec![2, 3, 4], vec![1, 2, 0]),
        (vec![2, 3, 4], vec![0, 2, 1]),
        (vec![3, 4], vec![1, 0]),
        (vec![2, 3, 2, 4], vec![0, 2, 1, 3]),
        (vec![2, 3, 2, 4], vec![3, 1, 0, 2]),
    ];
    for (k, (dims, perm)) in cases.into_iter().enumerate() {
        let mut c = Case::new(&format!("permute_{k}"), 60 + k as u64);
        let x = c.param("x", ls(&dims), Init::Normal(1.0));
        let y = c.op(Op::Permute { perm }, &[x]);
        gradcheck(&c.finish(y));
    }
}

#[test]
fn slice() {
    // (shape, axis, start, end)
    let cases: Vec<(Shape, usize, u64, u64)> = vec![
        (ls(&[4, 6]), 1, 0, 2), // start at 0
        (ls(&[4, 6]), 1, 2, 4), // middle
        (ls(&[4, 6]), 1, 4, 6), // end
        (ls(&[4, 6]), 1, 0, 6), // everything
        (ls(&[4, 6]), 0, 1, 3),
        (ls(&[2, 3, 5]), 2, 1, 4),
        (ls(&[5, 2, 3]), 0, 4, 5),
        (shp(&[sym("B"), lit(6)]), 1, 2, 5), // symbolic other dims
    ];
    for (k, (shape, axis, start, end)) in cases.into_iter().enumerate() {
        let mut c = Case::new(&format!("slice_{k}"), 80 + k as u64);
        let x = c.param("x", shape, Init::Normal(1.0));
        let y = c.op(Op::Slice { axis, start, end }, &[x]);
        gradcheck(&c.finish(y));
    }
}

#[test]
fn concat() {
    {
        let mut c = Case::new("concat_axis0", 90);
        let a = c.param("a", ls(&[2, 3]), Init::Normal(1.0));
        let b = c.param("b", ls(&[1, 3]), Init::Normal(1.0));
        let d = c.param("d", ls(&[3, 3]), Init::Normal(1.0));
        let y = c.op(Op::Concat { axis: 0 }, &[a, b, d]);
        gradcheck(&c.finish(y));
    }
    {
        let mut c = Case::new("concat_axis1_same_twice", 91);
        let a = c.param("a", ls(&[2, 3]), Init::Normal(1.0));
        let e = c.op(Op::Unary(UnaryOp::Exp), &[a]);
        let y = c.op(Op::Concat { axis: 1 }, &[a, e, a]);
        gradcheck(&c.finish(y));
    }
    {
        let mut c = Case::new("concat_axis2_symbolic", 92);
        let a = c.param("a", shp(&[sym("B"), lit(2), lit(1)]), Init::Normal(1.0));
        let b = c.param("b", shp(&[sym("B"), lit(2), lit(3)]), Init::Normal(1.0));
        let y = c.op(Op::Concat { axis: 2 }, &[a, b]);
        let z = c.op(Op::Unary(UnaryOp::Tanh), &[y]);
        gradcheck(&c.finish(z));
    }
    {
        let mut c = Case::new("concat_single", 93);
        let a = c.param("a", ls(&[2, 3]), Init::Normal(1.0));
        let y = c.op(Op::Concat { axis: 1 }, &[a]);
        gradcheck(&c.finish(y));
    }
}
