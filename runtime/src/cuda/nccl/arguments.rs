//! The checks a collective's device arguments pass before anything is
//! enqueued, as the CPU communicator makes them: dtypes, lengths against
//! the group's size, count vectors against their buffers, and overlaps
//! (NCCL allows only its exact in-place layouts; any other overlap would
//! race on the GPU). Each returns the problem in words; the communicator
//! adds the rank, the call and the group. The copy transport
//! ([`crate::cuda::peer_copy`]) makes the same checks.

use crate::cuda::GpuView;
use crate::view::DType;

pub(crate) type Problem = String;

/// `[start, end)` of a view's bytes; `None` when it overflows the address
/// space (a view no allocation can have).
fn byte_range(view: &GpuView) -> Option<(u64, u64)> {
    let bytes = u64::try_from(view.len.checked_mul(view.dtype.bytes())?).ok()?;
    Some((view.ptr, view.ptr.checked_add(bytes)?))
}

fn range_of(name: &str, view: &GpuView) -> Result<(u64, u64), Problem> {
    byte_range(view).ok_or_else(|| {
        format!(
            "`{name}` ({} {} elements at {:#x}) runs past the end of the address space",
            view.len, view.dtype, view.ptr
        )
    })
}

fn overlaps(a: (u64, u64), b: (u64, u64)) -> bool {
    a.0 < b.1 && b.0 < a.1 && a.0 != a.1 && b.0 != b.1
}

fn times(len: usize, ranks: usize) -> Result<usize, Problem> {
    len.checked_mul(ranks)
        .ok_or_else(|| format!("{len} elements x {ranks} ranks overflows"))
}

/// `shard` (S elements) gathered from `ranks` ranks into `full` (S x
/// ranks, same dtype). In place only as `shard` = this rank's slot of
/// `full`.
pub(crate) fn all_gather(
    ranks: usize,
    rank: usize,
    shard: &GpuView,
    full: &GpuView,
) -> Result<(), Problem> {
    let want = times(shard.len, ranks)?;
    if full.len != want || full.dtype != shard.dtype {
        return Err(format!(
            "the output holds {} {} elements but {ranks} ranks x {} shard elements of {} = {want}",
            full.len, full.dtype, shard.len, shard.dtype
        ));
    }
    in_place_or_apart(("shard", shard), ("full", full), rank)
}

/// `full` (S x ranks f32) summed over the ranks, this rank's S into
/// `shard`. In place only as `shard` = this rank's slot of `full`.
pub(crate) fn reduce_scatter(
    ranks: usize,
    rank: usize,
    full: &GpuView,
    shard: &GpuView,
) -> Result<(), Problem> {
    f32_only("full", full)?;
    f32_only("shard", shard)?;
    let want = times(shard.len, ranks)?;
    if full.len != want {
        return Err(format!(
            "the input holds {} elements but {ranks} ranks x {} shard elements = {want}",
            full.len, shard.len
        ));
    }
    in_place_or_apart(("shard", shard), ("full", full), rank)
}

/// An f32 buffer summed in place.
pub(crate) fn all_reduce(buf: &GpuView) -> Result<(), Problem> {
    f32_only("buf", buf)?;
    range_of("buf", buf).map(|_| ())
}

/// `send` cut by `send_counts` to the ranks, `recv` filled by
/// `recv_counts` from them: one count per rank, counts adding up to the
/// buffers, the same dtype, no overlap, and what this rank sends itself
/// equal to what it expects from itself.
pub(crate) fn all_to_all(
    ranks: usize,
    rank: usize,
    send: &GpuView,
    send_counts: &[usize],
    recv: &GpuView,
    recv_counts: &[usize],
) -> Result<(), Problem> {
    if send.dtype != recv.dtype {
        return Err(format!("send is {} but recv is {}", send.dtype, recv.dtype));
    }
    for (what, counts, buffer) in [
        ("send", send_counts, send.len),
        ("recv", recv_counts, recv.len),
    ] {
        if counts.len() != ranks {
            return Err(format!(
                "{what}_counts has {} entries but the group has {ranks} ranks",
                counts.len()
            ));
        }
        let total = counts
            .iter()
            .try_fold(0usize, |acc, &c| acc.checked_add(c))
            .ok_or_else(|| format!("{what}_counts overflow when added up"))?;
        if total != buffer {
            return Err(format!(
                "{what}_counts add up to {total} but the {what} buffer holds {buffer} elements"
            ));
        }
    }
    if send_counts[rank] != recv_counts[rank] {
        return Err(format!(
            "this rank sends itself {} elements (send_counts[{rank}]) but expects {} \
             (recv_counts[{rank}])",
            send_counts[rank], recv_counts[rank]
        ));
    }
    let (s, r) = (range_of("send", send)?, range_of("recv", recv)?);
    if overlaps(s, r) {
        return Err("the send and recv buffers overlap".into());
    }
    Ok(())
}

/// Point-to-point transfers issued together, each a view and a peer (a
/// rank of the group): at least one, peers in the group and none this
/// rank, and no byte a receive writes shared with any other view (they
/// all run at once).
pub(crate) fn send_recv(
    ranks: usize,
    rank: usize,
    sends: &[(GpuView, usize)],
    recvs: &[(GpuView, usize)],
) -> Result<(), Problem> {
    if sends.is_empty() && recvs.is_empty() {
        return Err("neither a send nor a receive was given".into());
    }
    let halves = sends
        .iter()
        .map(|half| (half, "send to", "send"))
        .chain(recvs.iter().map(|half| (half, "receive from", "recv")));
    for ((_, peer), verb, _) in halves.clone() {
        if *peer >= ranks {
            return Err(format!(
                "cannot {verb} rank {peer}: the group has {ranks} ranks"
            ));
        }
        if *peer == rank {
            return Err(format!("cannot {verb} itself (rank {peer} is this rank)"));
        }
    }
    let ranges = halves
        .map(|((view, _), _, name)| range_of(name, view).map(|range| (range, name)))
        .collect::<Result<Vec<_>, _>>()?;
    // Receives come after the sends: each is checked against every view
    // before it.
    for (i, (written, _)) in ranges.iter().enumerate().skip(sends.len()) {
        if let Some((_, other)) = ranges[..i].iter().find(|(r, _)| overlaps(*r, *written)) {
            return Err(match *other {
                "send" => "the send and recv buffers overlap".into(),
                _ => "two recv buffers overlap".into(),
            });
        }
    }
    Ok(())
}

fn f32_only(name: &str, view: &GpuView) -> Result<(), Problem> {
    if view.dtype == DType::F32 {
        Ok(())
    } else {
        Err(format!(
            "`{name}` is {}, but reductions run on f32 (gradients are reduced in f32)",
            view.dtype
        ))
    }
}

/// A shard and its full buffer either share no byte, or the shard is
/// exactly this rank's slot of the full buffer (NCCL's in-place form).
fn in_place_or_apart(
    (shard_name, shard): (&str, &GpuView),
    (full_name, full): (&str, &GpuView),
    rank: usize,
) -> Result<(), Problem> {
    let s = range_of(shard_name, shard)?;
    let f = range_of(full_name, full)?;
    if !overlaps(s, f) {
        return Ok(());
    }
    let slot = (s.1 - s.0)
        .checked_mul(rank as u64)
        .and_then(|offset| f.0.checked_add(offset));
    if slot == Some(s.0) {
        Ok(())
    } else {
        Err(format!(
            "`{shard_name}` overlaps `{full_name}` but is not this rank's slot of it (rank \
             {rank}'s slot starts {} bytes in); use separate buffers or exactly that slot",
            (s.1 - s.0).saturating_mul(rank as u64)
        ))
    }
}

/// NCCL's name for a dtype.
pub(super) fn nccl_type(dtype: DType) -> cudarc::nccl::sys::ncclDataType_t {
    use cudarc::nccl::sys::ncclDataType_t as T;
    match dtype {
        DType::F32 => T::ncclFloat32,
        DType::Bf16 => T::ncclBfloat16,
        DType::F64 => T::ncclFloat64,
        DType::U32 => T::ncclUint32,
    }
}

/// Offsets (in elements) of the segments `counts` cut a buffer into.
pub(super) fn offsets(counts: &[usize]) -> Vec<usize> {
    counts
        .iter()
        .scan(0usize, |at, &c| {
            let start = *at;
            *at += c;
            Some(start)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(ptr: u64, len: usize, dtype: DType) -> GpuView {
        GpuView::new(ptr, len, dtype)
    }

    #[test]
    fn all_gather_checks_sizes_dtypes_and_in_place_layout() {
        let shard = view(0x1000, 3, DType::Bf16);
        assert!(all_gather(2, 1, &shard, &view(0x2000, 6, DType::Bf16)).is_ok());
        let err = all_gather(2, 1, &shard, &view(0x2000, 5, DType::Bf16)).unwrap_err();
        assert_eq!(
            err,
            "the output holds 5 bf16 elements but 2 ranks x 3 shard elements of bf16 = 6"
        );
        assert!(all_gather(2, 1, &shard, &view(0x2000, 6, DType::F32)).is_err());
        // In place: rank 1's slot of a 6-element bf16 buffer starts 6 bytes in.
        let full = view(0x2000, 6, DType::Bf16);
        assert!(all_gather(2, 1, &view(0x2006, 3, DType::Bf16), &full).is_ok());
        let err = all_gather(2, 0, &view(0x2006, 3, DType::Bf16), &full).unwrap_err();
        assert!(err.contains("not this rank's slot"), "{err}");
        // Zero-length views overlap nothing.
        assert!(
            all_gather(
                2,
                0,
                &view(0x2000, 0, DType::F32),
                &view(0x2000, 0, DType::F32)
            )
            .is_ok()
        );
    }

    #[test]
    fn reductions_take_f32_only() {
        let err = all_reduce(&view(0x10, 4, DType::Bf16)).unwrap_err();
        assert!(err.contains("`buf` is bf16"), "{err}");
        assert!(all_reduce(&view(0x10, 4, DType::F32)).is_ok());
        let full = view(0x1000, 8, DType::F32);
        assert!(reduce_scatter(2, 1, &full, &view(0x3000, 4, DType::F32)).is_ok());
        assert!(reduce_scatter(2, 1, &full, &view(0x1010, 4, DType::F32)).is_ok());
        let err = reduce_scatter(2, 1, &full, &view(0x3000, 3, DType::F32)).unwrap_err();
        assert_eq!(
            err,
            "the input holds 8 elements but 2 ranks x 3 shard elements = 6"
        );
        assert!(
            reduce_scatter(
                2,
                1,
                &view(0x1000, 8, DType::Bf16),
                &view(0x3000, 4, DType::F32)
            )
            .is_err()
        );
    }

    #[test]
    fn all_to_all_checks_counts_against_buffers() {
        let send = view(0x1000, 5, DType::F32);
        let recv = view(0x2000, 4, DType::F32);
        assert!(all_to_all(2, 0, &send, &[2, 3], &recv, &[2, 2]).is_ok());
        let err = all_to_all(2, 0, &send, &[2, 3, 0], &recv, &[2, 2]).unwrap_err();
        assert_eq!(err, "send_counts has 3 entries but the group has 2 ranks");
        let err = all_to_all(2, 0, &send, &[2, 2], &recv, &[2, 2]).unwrap_err();
        assert_eq!(
            err,
            "send_counts add up to 4 but the send buffer holds 5 elements"
        );
        let err = all_to_all(2, 0, &send, &[1, 4], &recv, &[2, 2]).unwrap_err();
        assert!(err.contains("sends itself 1 elements"), "{err}");
        let err =
            all_to_all(2, 0, &send, &[2, 3], &view(0x2000, 4, DType::Bf16), &[2, 2]).unwrap_err();
        assert_eq!(err, "send is f32 but recv is bf16");
        let err =
            all_to_all(2, 0, &send, &[2, 3], &view(0x1008, 4, DType::F32), &[2, 2]).unwrap_err();
        assert_eq!(err, "the send and recv buffers overlap");
        let err = all_to_all(2, 0, &send, &[usize::MAX, 1], &recv, &[2, 2]).unwrap_err();
        assert!(err.contains("overflow"), "{err}");
    }

    #[test]
    fn send_recv_checks_peers_and_overlap() {
        let a = view(0x1000, 4, DType::F32);
        let b = view(0x2000, 4, DType::Bf16);
        assert!(send_recv(3, 1, &[(a, 2)], &[(b, 0)]).is_ok());
        assert!(send_recv(3, 1, &[(a, 0)], &[]).is_ok());
        assert!(send_recv(3, 1, &[], &[(b, 2)]).is_ok());
        let err = send_recv(3, 1, &[], &[]).unwrap_err();
        assert_eq!(err, "neither a send nor a receive was given");
        let err = send_recv(3, 1, &[(a, 1)], &[]).unwrap_err();
        assert_eq!(err, "cannot send to itself (rank 1 is this rank)");
        let err = send_recv(3, 1, &[], &[(b, 3)]).unwrap_err();
        assert_eq!(err, "cannot receive from rank 3: the group has 3 ranks");
        let err = send_recv(3, 1, &[(a, 0)], &[(view(0x100c, 2, DType::F32), 2)]).unwrap_err();
        assert_eq!(err, "the send and recv buffers overlap");
        // Views that only touch share no byte.
        assert!(send_recv(3, 1, &[(a, 0)], &[(view(0x1010, 2, DType::F32), 2)]).is_ok());
        // Several at once: sends may share bytes (they are only read), two
        // receives may not.
        assert!(
            send_recv(
                3,
                1,
                &[(a, 0), (a, 2)],
                &[(b, 0), (view(0x2008, 4, DType::Bf16), 2)]
            )
            .is_ok()
        );
        let err =
            send_recv(3, 1, &[(a, 0)], &[(b, 0), (view(0x2004, 1, DType::F32), 2)]).unwrap_err();
        assert_eq!(err, "two recv buffers overlap");
    }

    #[test]
    fn views_past_the_address_space_are_refused() {
        let err = all_reduce(&view(u64::MAX - 4, 4, DType::F32)).unwrap_err();
        assert!(err.contains("past the end of the address space"), "{err}");
    }

    #[test]
    fn segment_offsets() {
        assert_eq!(offsets(&[2, 0, 3, 1]), vec![0, 2, 2, 5]);
        assert_eq!(offsets(&[]), Vec::<usize>::new());
    }
}
