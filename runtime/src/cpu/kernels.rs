//! f32 reference kernels: deterministic loops, each next to the maths it
//! computes (the maths is documented on the [`Backend`](crate::Backend)
//! method each one implements) and, in its tests, next to a naive reference.
//!
//! Every kernel validates view lengths against its dimensions first, so a
//! bad size from a caller is an `InvalidArgument` error, never a panic; the
//! loops after that index within the checked bounds. Loop orders are fixed
//! and no kernel uses threads, so equal inputs give equal bits.

mod check;
mod moe;

pub use moe::{
    gather_rows, moe_aux_loss_backward, moe_aux_loss_forward, moe_combine, moe_expert_counts,
    moe_expert_major_order, moe_route_backward, moe_route_forward, moe_sort_by_expert,
    moe_unpermute, moe_unpermute_backward, scatter_rows,
};
