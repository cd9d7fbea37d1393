//! Bad indices the kernels find on the device. Index data (token targets,
//! selected experts, row indices) lives on the device, so it is checked
//! there: a kernel that finds a bad index reports it into its kernel set's
//! fault word (the lowest bad element of a kind wins) and skips it; a host
//! read brings the word back with its data, and [`DeviceFault`] says which
//! index of which kind was bad.

use std::fmt;

/// A bad index a kernel found on the device (`FAULT_*` in `common.cuh`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceFault {
    pub code: u32,
    /// The lowest bad element (row, slot or range) of that kind.
    pub index: u64,
}

impl DeviceFault {
    /// The word's value while no kernel has reported a fault.
    pub(crate) const NONE: u64 = u64::MAX;

    /// The kernels that report this fault (what an error names).
    pub fn kernels(&self) -> &'static str {
        match self.code {
            1 => {
                "cross_entropy_forward / cross_entropy_backward / cross_entropy_loss / \
                 cross_entropy_gradient"
            }
            2 => "moe_expert_counts / moe_sort_by_expert / moe_route_backward",
            3 => "moe_sort_by_expert / moe_expert_major_order",
            4 => "gather_rows / scatter_rows",
            5 => "moe_unpermute / moe_unpermute_backward_rows",
            6 => "adam_update / sgd_update",
            7 => "embedding_forward / embedding_backward_order",
            8 => {
                "dsa_mqa_forward / dsa_mqa_forward_mma / dsa_mqa_forward_wgmma / \
                 dsa_mqa_backward_dq / dsa_mqa_backward_mma / dsa_mqa_backward_wgmma / \
                 dsa_indexer_loss / dsa_indexer_loss_target_mma / dsa_indexer_loss_target_wgmma"
            }
            _ => "an unknown kernel",
        }
    }

    pub(crate) fn decode(word: u64) -> Option<DeviceFault> {
        (word != Self::NONE).then_some(DeviceFault {
            code: (word >> 40) as u32,
            index: word & ((1 << 40) - 1),
        })
    }
}

impl fmt::Display for DeviceFault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let i = self.index;
        match self.code {
            1 => write!(f, "the loss target of row {i} is past the vocabulary"),
            2 => write!(
                f,
                "the expert selected in routing slot {i} is past the expert count"
            ),
            3 => write!(
                f,
                "the expert counts do not match the routing (at slot {i})"
            ),
            4 => write!(
                f,
                "the row index at position {i} of a gather or scatter is out of range"
            ),
            5 => write!(f, "the unpermute position of slot {i} is out of range"),
            6 => write!(f, "decayed range {i} is out of order or outside the shard"),
            7 => write!(f, "the token id of row {i} is past the vocabulary"),
            8 => write!(
                f,
                "query row {i} of the sparse attention selected a key out of range or the same \
                 key twice"
            ),
            code => write!(f, "unknown device fault {code} at {i}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kernel a fault names is an entry point of the kernel sources
    /// (a renamed or removed kernel would leave an error naming nothing).
    #[test]
    fn every_kernel_a_fault_names_exists() {
        let entry_points: Vec<&str> = crate::cuda::kernels::SOURCES
            .iter()
            .flat_map(|s| s.entry_points.iter().copied())
            .collect();
        for code in 1..=8 {
            let fault = DeviceFault { code, index: 0 };
            for name in fault.kernels().split(" / ") {
                assert!(
                    entry_points.contains(&name),
                    "fault {code} names `{name}`, which no kernel source defines"
                );
            }
        }
        assert_eq!(
            DeviceFault { code: 9, index: 0 }.kernels(),
            "an unknown kernel"
        );
    }
}
