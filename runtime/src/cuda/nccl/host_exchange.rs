//! The host-side exchanges of a communicator (count vectors, small f64
//! vectors, barriers, split colours) as NCCL all-gathers of fixed-size
//! blocks of 64-bit words: how a rank's call is encoded, and how the
//! gathered blocks are checked and decoded. No GPU here, so all of it is
//! tested on any machine.
//!
//! Every exchange is the same NCCL operation (an all-gather of `block`
//! words per rank), whatever the call, so ranks that call different
//! exchanges still meet, and each block's header says which call it is:
//! a rank whose peer called something else reports both calls instead of
//! hanging. A block holds a header and as much of the payload as fits; when
//! some rank's payload is longer, every rank sees that in the gathered
//! headers and runs a second all-gather for the rest, and all of them grow
//! their block for the next exchange (the same decision everywhere, taken
//! from the same headers). A call refused by its own rank's checks is still
//! exchanged, carrying the reason, so its peers fail at once naming it.

use std::fmt;

/// Words of a block's header: call, sequence number, payload length, flags.
pub(super) const HEADER_WORDS: usize = 4;
/// Words of a block before any exchange needed more.
pub(super) const FIRST_BLOCK_WORDS: usize = 64;
/// Flag: the payload is the UTF-8 reason this rank's call was refused.
const REFUSED: u64 = 1;
/// The longest payload a host-side exchange moves (8 MiB): these carry
/// counts and a few values, never tensors.
pub(super) const MAX_PAYLOAD_WORDS: usize = 1 << 20;

/// Which host-side exchange a call is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum HostOp {
    Barrier,
    AllGatherHost,
    AllToAllCounts,
    Split,
}

impl HostOp {
    const ALL: [HostOp; 4] = [
        HostOp::Barrier,
        HostOp::AllGatherHost,
        HostOp::AllToAllCounts,
        HostOp::Split,
    ];

    fn code(self) -> u64 {
        match self {
            HostOp::Barrier => 1,
            HostOp::AllGatherHost => 2,
            HostOp::AllToAllCounts => 3,
            HostOp::Split => 4,
        }
    }

    fn from_code(code: u64) -> Option<HostOp> {
        Self::ALL.into_iter().find(|op| op.code() == code)
    }

    pub(super) fn name(self) -> &'static str {
        match self {
            HostOp::Barrier => "barrier",
            HostOp::AllGatherHost => "all_gather_host",
            HostOp::AllToAllCounts => "all_to_all_counts",
            HostOp::Split => "split",
        }
    }
}

/// One numbered host-side call: what every rank of the group must agree on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct HostCall {
    pub op: HostOp,
    /// Counts this communicator's host-side calls from 1.
    pub seq: u64,
}

impl fmt::Display for HostCall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} #{}", self.op.name(), self.seq)
    }
}

/// What one rank puts into an exchange.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Contribution {
    Words(Vec<u64>),
    /// This rank's own checks refused the call, for this reason.
    Refused(String),
}

impl Contribution {
    fn payload(&self) -> Vec<u64> {
        match self {
            Contribution::Words(words) => words.clone(),
            Contribution::Refused(reason) => pack_text(reason),
        }
    }

    fn flags(&self) -> u64 {
        match self {
            Contribution::Words(_) => 0,
            Contribution::Refused(_) => REFUSED,
        }
    }
}

fn pack_text(text: &str) -> Vec<u64> {
    let bytes = text.as_bytes();
    let mut words = vec![bytes.len() as u64];
    words.extend(bytes.chunks(8).map(|chunk| {
        let mut word = [0u8; 8];
        word[..chunk.len()].copy_from_slice(chunk);
        u64::from_le_bytes(word)
    }));
    words
}

fn unpack_text(words: &[u64]) -> String {
    let Some((&len, rest)) = words.split_first() else {
        return String::new();
    };
    let bytes: Vec<u8> = rest.iter().flat_map(|w| w.to_le_bytes()).collect();
    let len = (len as usize).min(bytes.len());
    String::from_utf8_lossy(&bytes[..len]).into_owned()
}

/// The payload words of a block of `block` words.
fn inline_words(block: usize) -> usize {
    block.saturating_sub(HEADER_WORDS)
}

/// The encoding of one rank's call, for both rounds.
#[derive(Debug)]
pub(super) struct Outgoing {
    call: HostCall,
    flags: u64,
    payload: Vec<u64>,
}

impl Outgoing {
    pub fn new(call: HostCall, contribution: &Contribution) -> Self {
        Outgoing {
            call,
            flags: contribution.flags(),
            payload: contribution.payload(),
        }
    }

    /// The first round's block: header, then as much payload as fits,
    /// zero-padded to `block` words.
    pub fn first_block(&self, block: usize) -> Vec<u64> {
        let mut words = vec![
            self.call.op.code(),
            self.call.seq,
            self.payload.len() as u64,
            self.flags,
        ];
        let inline = self.payload.len().min(inline_words(block));
        words.extend_from_slice(&self.payload[..inline]);
        words.resize(block, 0);
        words
    }

    /// The second round's block: the payload past the first block,
    /// zero-padded to `overflow` words.
    pub fn second_block(&self, block: usize, overflow: usize) -> Vec<u64> {
        let start = inline_words(block).min(self.payload.len());
        let mut words = self.payload[start..].to_vec();
        words.resize(overflow, 0);
        words
    }
}

/// A rank's header, as gathered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Header {
    op: u64,
    seq: u64,
    len: usize,
    flags: u64,
}

/// The headers of the `ranks` blocks of a gathered first round.
pub(super) fn headers(gathered: &[u64], ranks: usize, block: usize) -> Vec<Header> {
    (0..ranks)
        .map(|r| {
            let at = |i: usize| gathered.get(r * block + i).copied().unwrap_or(0);
            Header {
                op: at(0),
                seq: at(1),
                len: usize::try_from(at(2)).unwrap_or(usize::MAX),
                flags: at(3),
            }
        })
        .collect()
}

/// Words every rank sends in a second round (0: none is needed): the
/// longest payload's part past the first block. A function of the gathered
/// headers alone, so every rank decides alike.
pub(super) fn overflow_words(headers: &[Header], block: usize) -> usize {
    let longest = headers.iter().map(|h| h.len).max().unwrap_or(0);
    longest.saturating_sub(inline_words(block))
}

/// The first rank whose payload is longer than [`MAX_PAYLOAD_WORDS`], and
/// its length: every rank finds the same one in the same headers, and all
/// stop before a second round of that size.
pub(super) fn oversized(headers: &[Header]) -> Option<(usize, usize)> {
    headers
        .iter()
        .enumerate()
        .find(|(_, h)| h.len > MAX_PAYLOAD_WORDS)
        .map(|(rank, h)| (rank, h.len))
}

/// The block size after an exchange: large enough for the longest payload
/// seen (a power of two), so a call that needed a second round once
/// needs one round from then on.
pub(super) fn next_block_words(headers: &[Header], block: usize) -> usize {
    let longest = headers.iter().map(|h| h.len).max().unwrap_or(0);
    longest
        .saturating_add(HEADER_WORDS)
        .checked_next_power_of_two()
        .unwrap_or(block)
        .max(block)
}

/// Every rank's whole payload, from the gathered first and (if any)
/// second rounds.
pub(super) fn payloads(
    headers: &[Header],
    first: &[u64],
    second: &[u64],
    block: usize,
    overflow: usize,
) -> Vec<Vec<u64>> {
    headers
        .iter()
        .enumerate()
        .map(|(r, h)| {
            let inline = h.len.min(inline_words(block));
            let start = r * block + HEADER_WORDS;
            let mut words = first.get(start..start + inline).unwrap_or(&[]).to_vec();
            let rest = h.len - inline;
            if rest > 0 {
                let start = r.saturating_mul(overflow);
                let end = start.saturating_add(rest);
                words.extend_from_slice(second.get(start..end).unwrap_or(&[]));
            }
            words
        })
        .collect()
}

/// Why an exchange failed, in terms of the group's ranks (indices into
/// it); the communicator turns these into errors with world ranks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Disagreement {
    /// Rank `rank` made a different call (`theirs`; `None` when its header
    /// names no exchange this build knows).
    OtherCall {
        rank: usize,
        theirs: Option<HostCall>,
    },
    /// Rank `rank`'s own checks refused its call.
    Refused { rank: usize, reason: String },
}

/// Checks that every rank made `mine` and none refused it (`me` is this
/// rank's index, whose own refusal the caller reports itself).
pub(super) fn check_agreement(
    mine: HostCall,
    me: usize,
    headers: &[Header],
    payloads: &[Vec<u64>],
) -> Result<(), Disagreement> {
    for (rank, h) in headers.iter().enumerate() {
        let theirs = HostOp::from_code(h.op).map(|op| HostCall { op, seq: h.seq });
        if theirs != Some(mine) {
            return Err(Disagreement::OtherCall { rank, theirs });
        }
    }
    for (rank, h) in headers.iter().enumerate() {
        if rank != me && h.flags & REFUSED != 0 {
            let reason = payloads
                .get(rank)
                .map(|p| unpack_text(p))
                .unwrap_or_default();
            return Err(Disagreement::Refused { rank, reason });
        }
    }
    Ok(())
}

// ---- the payloads of each call ------------------------------------------------

/// `all_to_all_counts`: the vectors' lengths, then the vectors.
pub(super) fn encode_counts(send: &[Vec<usize>]) -> Vec<u64> {
    let mut words: Vec<u64> = send.iter().map(|v| v.len() as u64).collect();
    for vector in send {
        words.extend(vector.iter().map(|&c| c as u64));
    }
    words
}

/// The vector rank `from`'s payload sends to rank `to` of `ranks`; `None`
/// when the payload is not a well-formed count exchange.
pub(super) fn decode_counts(payload: &[u64], ranks: usize, to: usize) -> Option<Vec<usize>> {
    let lens = payload.get(..ranks)?;
    let lens: Vec<usize> = lens
        .iter()
        .map(|&l| usize::try_from(l).ok())
        .collect::<Option<_>>()?;
    let total = lens.iter().try_fold(0usize, |acc, &l| acc.checked_add(l))?;
    if payload.len() != ranks + total {
        return None;
    }
    let start = ranks + lens[..to].iter().sum::<usize>();
    payload[start..start + lens[to]]
        .iter()
        .map(|&c| usize::try_from(c).ok())
        .collect()
}

/// `all_gather_host`: the values' bits.
pub(super) fn encode_values(values: &[f64]) -> Vec<u64> {
    values.iter().map(|v| v.to_bits()).collect()
}

pub(super) fn decode_values(payload: &[u64]) -> Vec<f64> {
    payload.iter().map(|&w| f64::from_bits(w)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What an all-gather of the ranks' blocks gives every rank.
    fn gather(blocks: &[Vec<u64>]) -> Vec<u64> {
        blocks.concat()
    }

    /// What each simulated rank got: every payload, or its disagreement.
    type Outcomes = Vec<Result<Vec<Vec<u64>>, Disagreement>>;

    /// The whole protocol among simulated ranks: returns each rank's
    /// outcome, the second round's words and the next block size.
    fn exchange(calls: &[(HostCall, Contribution)], block: usize) -> (Outcomes, usize, usize) {
        let n = calls.len();
        let outgoing: Vec<Outgoing> = calls.iter().map(|(c, x)| Outgoing::new(*c, x)).collect();
        let first = gather(
            &outgoing
                .iter()
                .map(|o| o.first_block(block))
                .collect::<Vec<_>>(),
        );
        let heads = headers(&first, n, block);
        let overflow = overflow_words(&heads, block);
        let second = if overflow > 0 {
            gather(
                &outgoing
                    .iter()
                    .map(|o| o.second_block(block, overflow))
                    .collect::<Vec<_>>(),
            )
        } else {
            Vec::new()
        };
        let all = payloads(&heads, &first, &second, block, overflow);
        let results = (0..n)
            .map(|me| check_agreement(calls[me].0, me, &heads, &all).map(|()| all.clone()))
            .collect();
        (results, overflow, next_block_words(&heads, block))
    }

    fn call(op: HostOp, seq: u64) -> HostCall {
        HostCall { op, seq }
    }

    #[test]
    fn short_payloads_take_one_round_and_come_back_whole() {
        let c = call(HostOp::AllGatherHost, 3);
        let a = encode_values(&[1.5, -0.0, f64::NAN]);
        let b = encode_values(&[]);
        let (results, overflow, next) = exchange(
            &[
                (c, Contribution::Words(a.clone())),
                (c, Contribution::Words(b.clone())),
            ],
            FIRST_BLOCK_WORDS,
        );
        assert_eq!(overflow, 0);
        assert_eq!(next, FIRST_BLOCK_WORDS);
        for result in results {
            let all = result.unwrap();
            assert_eq!(all, vec![a.clone(), b.clone()]);
            let values = decode_values(&all[0]);
            assert_eq!(values[0], 1.5);
            assert_eq!(values[1].to_bits(), (-0.0f64).to_bits());
            assert!(values[2].is_nan());
        }
    }

    #[test]
    fn long_payloads_take_a_second_round_and_grow_the_block() {
        let c = call(HostOp::AllToAllCounts, 1);
        let long: Vec<Vec<usize>> = vec![(0..100).collect(), vec![7; 3], vec![]];
        let short: Vec<Vec<usize>> = vec![vec![1], vec![], vec![2, 3]];
        let calls = [
            (c, Contribution::Words(encode_counts(&long))),
            (c, Contribution::Words(encode_counts(&short))),
            (c, Contribution::Words(encode_counts(&short))),
        ];
        let (results, overflow, next) = exchange(&calls, FIRST_BLOCK_WORDS);
        // 3 lengths + 103 counts, of which 60 fit in the first block.
        assert_eq!(overflow, 3 + 103 - (FIRST_BLOCK_WORDS - HEADER_WORDS));
        assert_eq!(next, 128);
        for (me, result) in results.into_iter().enumerate() {
            let all = result.unwrap();
            let got: Vec<Vec<usize>> = (0..3)
                .map(|from| decode_counts(&all[from], 3, me).unwrap())
                .collect();
            let sent = |from: usize| if from == 0 { &long } else { &short };
            let want: Vec<Vec<usize>> = (0..3).map(|from| sent(from)[me].clone()).collect();
            assert_eq!(got, want, "rank {me}");
        }
        // With the grown block, the same call takes one round.
        let (_, overflow, again) = exchange(&calls, next);
        assert_eq!((overflow, again), (0, next));
    }

    #[test]
    fn different_calls_are_reported_with_both_sides() {
        let (results, _, _) = exchange(
            &[
                (call(HostOp::Barrier, 4), Contribution::Words(vec![])),
                (call(HostOp::AllGatherHost, 4), Contribution::Words(vec![1])),
            ],
            FIRST_BLOCK_WORDS,
        );
        assert_eq!(
            results[0],
            Err(Disagreement::OtherCall {
                rank: 1,
                theirs: Some(call(HostOp::AllGatherHost, 4)),
            })
        );
        assert_eq!(
            results[1],
            Err(Disagreement::OtherCall {
                rank: 0,
                theirs: Some(call(HostOp::Barrier, 4)),
            })
        );
        // The same call out of step (sequence numbers differ) disagrees too.
        let (results, _, _) = exchange(
            &[
                (call(HostOp::Barrier, 4), Contribution::Words(vec![])),
                (call(HostOp::Barrier, 5), Contribution::Words(vec![])),
            ],
            FIRST_BLOCK_WORDS,
        );
        assert!(results.iter().all(Result::is_err));
        // A header of no known call.
        let heads = headers(&[99, 1, 0, 0], 1, 4);
        assert_eq!(
            check_agreement(call(HostOp::Barrier, 1), 0, &heads, &[vec![]]),
            Err(Disagreement::OtherCall {
                rank: 0,
                theirs: None
            })
        );
    }

    #[test]
    fn a_refused_call_reaches_the_peers_with_its_reason() {
        let c = call(HostOp::AllToAllCounts, 2);
        let reason = "3 count vectors were given but the group has 2 ranks ".repeat(20);
        let (results, overflow, _) = exchange(
            &[
                (c, Contribution::Refused(reason.clone())),
                (c, Contribution::Words(encode_counts(&[vec![1], vec![2]]))),
            ],
            FIRST_BLOCK_WORDS,
        );
        assert!(overflow > 0, "a long reason takes the second round too");
        // The refusing rank reports its own error; its peer names it.
        assert!(results[0].is_ok());
        assert_eq!(results[1], Err(Disagreement::Refused { rank: 0, reason }));
    }

    #[test]
    fn oversized_payloads_are_found_before_a_second_round() {
        let heads = headers(&[2, 1, 3, 0, 2, 1, u64::MAX, 0], 2, 4);
        assert_eq!(oversized(&heads), Some((1, usize::MAX)));
        let heads = headers(&[2, 1, 3, 0, 2, 1, 5, 0], 2, 4);
        assert_eq!(oversized(&heads), None);
    }

    #[test]
    fn malformed_count_payloads_are_refused() {
        assert_eq!(
            decode_counts(&encode_counts(&[vec![4, 5], vec![6]]), 2, 1),
            Some(vec![6])
        );
        assert_eq!(decode_counts(&[1], 2, 0), None);
        assert_eq!(decode_counts(&[1, 1, 9], 2, 0), None);
        assert_eq!(decode_counts(&[u64::MAX, 1, 9], 2, 0), None);
    }

    #[test]
    fn text_survives_packing() {
        for text in ["", "a", "exactly8", "ünïcödé and more than eight bytes"] {
            assert_eq!(unpack_text(&pack_text(text)), text);
        }
    }
}
