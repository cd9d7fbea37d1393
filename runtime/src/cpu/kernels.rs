//! f32 reference kernels: deterministic loops, each next to the maths it computes.
