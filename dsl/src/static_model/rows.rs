//! The compact text form of the generated `const` tables, and the `const fn`s
//! that read it back into the planner's own types at compile time.
//!
//! A 1,000-layer model has tens of thousands of table entries. Written as
//! Rust expressions they cost a macro hundreds of thousands of tokens to
//! build (and the compiler as many to parse); written as one string literal
//! per table they cost one token, and `rustc` decodes them once while
//! evaluating the `const`s. The decoded values are ordinary `Param`s,
//! `Bucket`s, `FsdpUnit`s, ... (tests compare them to the run-time plan).
//!
//! The format: whole numbers in decimal, `-` for `None`, fields separated by
//! a space and rows by a newline (readers accept any separator). Strings
//! are Rust string literals in arrays of their own (`PARAM_NAMES`,
//! `__PATHS`), referred to by index. Codes:
//! - layer kind: its index in [`LayerKind::ALL`] (`M * + D G - E` = 0..6);
//! - layer: `0 i` decoder layer `i`, `1 d j` layer `j` of MTP depth `d`;
//! - owner: `0 0 0` embedding, `1 i 0` decoder layer, `2 d j` MTP layer,
//!   `3 0 0` final norm, `4 d 0` MTP depth `d`'s own parameters, `5 0 0`
//!   output layer;
//! - unit shape: `0` group, `1` layer, `2` MTP depth;
//! - op: `0` embed, `1 d` MTP enter, `2..=7 layer` layer / MoE prepare /
//!   dispatch / experts / combine / MLP, `8` final norm, `9 d?` head.
//!
//! Table rows:
//! - params: number arrays, not text (see [`params`]);
//! - buckets: `unit? expert numel end lcm? count` (the next `count` entries
//!   of [`bucket_members`] are its parameters);
//! - units: `path shape layer_count mtp_depth? bucket_count` (layers, then
//!   buckets, from the unit lists);
//! - schedule nodes: `path logical? mtp_depth? unit? pre_count terminal
//!   embed mtp_enter? final_norm head_count`, terminal `-` or `kind layer`
//!   (pre-layers from the layer list, heads from the head list);
//! - slot tables: the op counts of the five slots (ops from the op list);
//! - layer handles: `layer kind path first_param end_param`;
//! - modules (logical layers, then MTP depths): `path unit? node first_handle`.
//!
//! Readers index past the end of a malformed table, which is a compile
//! error in a `const`; the generator writes what they read (round-trip tests
//! below), so that cannot happen to generated code.

use super::{LayerHandle, SlotTable};
use crate::pattern::LayerKind;
use crate::plan::{Bucket, DType, FsdpUnit, LayerRef, Op, Owner, Param, ScheduleNode, UnitShape};
use std::borrow::Cow;

/// One module of the tree the typed layer structs are read from: a logical
/// layer or an MTP depth.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ModuleEntry {
    /// Module path (`decoder.layers.3`, `mtp.layers.0`).
    pub path: &'static str,
    /// The FSDP unit the module is, if any.
    pub unit: Option<usize>,
    /// Its first node in the schedule.
    pub node: usize,
    /// Index of its first member's [`LayerHandle`]; members are consecutive.
    pub first_handle: usize,
}

/// A read position in a table's text.
#[derive(Clone, Copy)]
struct Reader {
    bytes: &'static [u8],
    at: usize,
}

impl Reader {
    const fn new(text: &'static str) -> Reader {
        Reader {
            bytes: text.as_bytes(),
            at: 0,
        }
    }

    // The readers run in the compiler's `const` interpreter, where every
    // call and every statement costs: hence the hand-inlined loops, with no
    // method calls per byte.

    const fn skip_separators(&mut self) {
        let (bytes, mut at) = (self.bytes, self.at);
        while at < bytes.len() {
            let b = bytes[at];
            if (b >= b'0' && b <= b'9') || b == b'-' {
                break;
            }
            at += 1;
        }
        self.at = at;
    }

    const fn u64(&mut self) -> u64 {
        self.skip_separators();
        let (bytes, mut at) = (self.bytes, self.at);
        let mut n: u64 = 0;
        while at < bytes.len() {
            let b = bytes[at];
            if b < b'0' || b > b'9' {
                break;
            }
            n = n * 10 + (b - b'0') as u64;
            at += 1;
        }
        self.at = at;
        n
    }

    const fn number(&mut self) -> usize {
        self.u64() as usize
    }

    /// Consumes a `-` (None) if one comes next.
    const fn none(&mut self) -> bool {
        self.skip_separators();
        if self.at < self.bytes.len() && self.bytes[self.at] == b'-' {
            self.at += 1;
            true
        } else {
            false
        }
    }

    const fn option(&mut self) -> Option<usize> {
        if self.none() {
            None
        } else {
            Some(self.number())
        }
    }

    const fn option_u64(&mut self) -> Option<u64> {
        if self.none() { None } else { Some(self.u64()) }
    }

    const fn flag(&mut self) -> bool {
        self.number() != 0
    }

    const fn kind(&mut self) -> LayerKind {
        LayerKind::ALL[self.number()]
    }

    const fn layer(&mut self) -> LayerRef {
        match self.number() {
            0 => LayerRef::Decoder(self.number()),
            _ => {
                let depth = self.number();
                LayerRef::Mtp {
                    depth,
                    index: self.number(),
                }
            }
        }
    }

    const fn op(&mut self) -> Op {
        match self.number() {
            0 => Op::Embed,
            1 => Op::MtpEnter(self.number()),
            2 => Op::Layer(self.layer()),
            3 => Op::MoePrepare(self.layer()),
            4 => Op::MoeDispatch(self.layer()),
            5 => Op::MoeExperts(self.layer()),
            6 => Op::MoeCombine(self.layer()),
            7 => Op::Mlp(self.layer()),
            8 => Op::FinalNorm,
            _ => Op::Head(self.option()),
        }
    }
}

/// `list[at..at + count]`, in a `const`.
const fn window<T>(list: &'static [T], at: usize, count: usize) -> &'static [T] {
    let (_, rest) = list.split_at(at);
    let (window, _) = rest.split_at(count);
    window
}

pub const fn numbers<const N: usize>(text: &'static str) -> [usize; N] {
    let mut r = Reader::new(text);
    let mut out = [0; N];
    let mut i = 0;
    while i < N {
        out[i] = r.number();
        i += 1;
    }
    out
}

pub const fn options<const N: usize>(text: &'static str) -> [Option<usize>; N] {
    let mut r = Reader::new(text);
    let mut out = [None; N];
    let mut i = 0;
    while i < N {
        out[i] = r.option();
        i += 1;
    }
    out
}

pub const fn layers<const N: usize>(text: &'static str) -> [LayerRef; N] {
    let mut r = Reader::new(text);
    let mut out = [LayerRef::Decoder(0); N];
    let mut i = 0;
    while i < N {
        out[i] = r.layer();
        i += 1;
    }
    out
}

pub const fn ops<const N: usize>(text: &'static str) -> [Op; N] {
    let mut r = Reader::new(text);
    let mut out = [Op::Embed; N];
    let mut i = 0;
    while i < N {
        out[i] = r.op();
        i += 1;
    }
    out
}

/// The owner a parameter run names with three numbers (`tag x y`, the
/// owner codes above, unused numbers 0).
const fn owner_of(tag: usize, x: usize, y: usize) -> Owner {
    match tag {
        0 => Owner::Embedding,
        1 => Owner::Layer(LayerRef::Decoder(x)),
        2 => Owner::Layer(LayerRef::Mtp { depth: x, index: y }),
        3 => Owner::FinalNorm,
        4 => Owner::MtpBlock(x),
        _ => Owner::OutputLayer,
    }
}

/// The parameters, from runs and offsets: plain number arrays rather than
/// text, because this is the largest table (every expert of every MoE layer)
/// and the `const` interpreter reads an array element many times faster
/// than it parses a number from text. A run is six numbers, `tag x y
/// first_def count bucket`: `count` parameters of one owner with
/// consecutive definitions in one bucket; `offsets` has one entry per
/// parameter.
pub const fn params<const N: usize>(runs: &[usize], offsets: &[usize]) -> [Param; N] {
    let mut out = [Param {
        owner: Owner::Embedding,
        def: 0,
        bucket: 0,
        offset: 0,
    }; N];
    let (mut i, mut run) = (0, 0);
    while run + 6 <= runs.len() {
        let owner = owner_of(runs[run], runs[run + 1], runs[run + 2]);
        let (first_def, count, bucket) = (runs[run + 3], runs[run + 4], runs[run + 5]);
        let mut k = 0;
        while k < count {
            out[i] = Param {
                owner,
                def: first_def + k,
                bucket,
                offset: offsets[i],
            };
            i += 1;
            k += 1;
        }
        run += 6;
    }
    out
}

/// Each bucket's parameters (indices into `params`), bucket after bucket,
/// in parameter order (which is offset order): the lists `BUCKETS` cut
/// into windows, derived from `PARAMS` instead of written out.
pub const fn bucket_members<const N: usize, const B: usize>(params: &[Param]) -> [usize; N] {
    let mut start = [0; B];
    let mut i = 0;
    while i < params.len() {
        if params[i].bucket + 1 < B {
            start[params[i].bucket + 1] += 1;
        }
        i += 1;
    }
    let mut b = 1;
    while b < B {
        start[b] += start[b - 1];
        b += 1;
    }
    let mut out = [0; N];
    i = 0;
    while i < params.len() {
        let bucket = params[i].bucket;
        out[start[bucket]] = i;
        start[bucket] += 1;
        i += 1;
    }
    out
}

/// Writes the parameter runs and offsets [`params`] reads.
pub fn param_runs(params: &[Param]) -> (Vec<usize>, Vec<usize>) {
    let owner_numbers = |owner: Owner| match owner {
        Owner::Embedding => [0, 0, 0],
        Owner::Layer(LayerRef::Decoder(i)) => [1, i, 0],
        Owner::Layer(LayerRef::Mtp { depth, index }) => [2, depth, index],
        Owner::FinalNorm => [3, 0, 0],
        Owner::MtpBlock(d) => [4, d, 0],
        Owner::OutputLayer => [5, 0, 0],
    };
    let mut runs: Vec<usize> = Vec::new();
    let mut offsets = Vec::with_capacity(params.len());
    let mut open: Option<(Owner, usize, usize)> = None; // owner, next def, bucket
    for p in params {
        let continues = open == Some((p.owner, p.def, p.bucket));
        if continues {
            let len = runs.len();
            runs[len - 2] += 1;
        } else {
            runs.extend(owner_numbers(p.owner));
            runs.extend([p.def, 1, p.bucket]);
        }
        open = Some((p.owner, p.def + 1, p.bucket));
        offsets.push(p.offset);
    }
    (runs, offsets)
}

pub const fn buckets<const N: usize>(text: &'static str, lists: &'static [usize]) -> [Bucket; N] {
    let mut r = Reader::new(text);
    let mut out = [const {
        Bucket {
            id: 0,
            unit: None,
            dtype: DType::Bf16,
            expert: false,
            params: Cow::Borrowed(&[]),
            numel: 0,
            end: 0,
            megatron_row_lcm: None,
        }
    }; N];
    let (mut i, mut at) = (0, 0);
    while i < N {
        let unit = r.option();
        let expert = r.flag();
        let numel = r.number();
        let end = r.number();
        let megatron_row_lcm = r.option_u64();
        let count = r.number();
        let bucket = Bucket {
            id: i,
            unit,
            dtype: DType::Bf16,
            expert,
            params: Cow::Borrowed(window(lists, at, count)),
            numel,
            end,
            megatron_row_lcm,
        };
        // Assignment would drop the placeholder, which a `const fn` cannot.
        core::mem::forget(core::mem::replace(&mut out[i], bucket));
        at += count;
        i += 1;
    }
    out
}

pub const fn units<const N: usize>(
    text: &'static str,
    paths: &'static [&'static str],
    lists: &'static [usize],
) -> [FsdpUnit; N] {
    let mut r = Reader::new(text);
    let mut out = [const {
        FsdpUnit {
            index: 0,
            name: Cow::Borrowed(""),
            shape: UnitShape::Layer,
            layers: Cow::Borrowed(&[]),
            mtp_depth: None,
            buckets: Cow::Borrowed(&[]),
        }
    }; N];
    let (mut i, mut at) = (0, 0);
    while i < N {
        let name = paths[r.number()];
        let shape = match r.number() {
            0 => UnitShape::Group,
            1 => UnitShape::Layer,
            _ => UnitShape::Mtp,
        };
        let layer_count = r.number();
        let mtp_depth = r.option();
        let bucket_count = r.number();
        let layers = window(lists, at, layer_count);
        let buckets = window(lists, at + layer_count, bucket_count);
        let unit = FsdpUnit {
            index: i,
            name: Cow::Borrowed(name),
            shape,
            layers: Cow::Borrowed(layers),
            mtp_depth,
            buckets: Cow::Borrowed(buckets),
        };
        core::mem::forget(core::mem::replace(&mut out[i], unit));
        at += layer_count + bucket_count;
        i += 1;
    }
    out
}

pub const fn nodes<const N: usize>(
    text: &'static str,
    paths: &'static [&'static str],
    layers: &'static [LayerRef],
    heads: &'static [Option<usize>],
) -> [ScheduleNode; N] {
    let mut r = Reader::new(text);
    let mut out = [const {
        ScheduleNode {
            index: 0,
            name: Cow::Borrowed(""),
            logical: None,
            mtp_depth: None,
            unit: None,
            pre_layers: Cow::Borrowed(&[]),
            terminal: None,
            embed: false,
            mtp_enter: None,
            final_norm: false,
            heads: Cow::Borrowed(&[]),
        }
    }; N];
    let (mut i, mut at_layer, mut at_head) = (0, 0, 0);
    while i < N {
        let name = paths[r.number()];
        let logical = r.option();
        let mtp_depth = r.option();
        let unit = r.option();
        let pre_count = r.number();
        let terminal = if r.none() {
            None
        } else {
            let kind = r.kind();
            Some((r.layer(), kind))
        };
        let embed = r.flag();
        let mtp_enter = r.option();
        let final_norm = r.flag();
        let head_count = r.number();
        let node = ScheduleNode {
            index: i,
            name: Cow::Borrowed(name),
            logical,
            mtp_depth,
            unit,
            pre_layers: Cow::Borrowed(window(layers, at_layer, pre_count)),
            terminal,
            embed,
            mtp_enter,
            final_norm,
            heads: Cow::Borrowed(window(heads, at_head, head_count)),
        };
        core::mem::forget(core::mem::replace(&mut out[i], node));
        at_layer += pre_count;
        at_head += head_count;
        i += 1;
    }
    out
}

pub const fn slot_tables<const N: usize>(text: &'static str, ops: &'static [Op]) -> [SlotTable; N] {
    let mut r = Reader::new(text);
    let mut out = [SlotTable::EMPTY; N];
    let (mut i, mut at) = (0, 0);
    while i < N {
        let counts = [r.number(), r.number(), r.number(), r.number(), r.number()];
        let mut slots: [&'static [Op]; 5] = [&[]; 5];
        let mut s = 0;
        while s < 5 {
            slots[s] = window(ops, at, counts[s]);
            at += counts[s];
            s += 1;
        }
        out[i] = SlotTable {
            pre_dispatch: slots[0],
            dispatch: slots[1],
            mlp: slots[2],
            combine: slots[3],
            mtp_post_process: slots[4],
        };
        i += 1;
    }
    out
}

pub const fn handles<const N: usize>(
    text: &'static str,
    paths: &'static [&'static str],
) -> [LayerHandle; N] {
    let mut r = Reader::new(text);
    let mut out = [LayerHandle {
        layer: LayerRef::Decoder(0),
        kind: LayerKind::Mamba,
        path: "",
        first_param: 0,
        end_param: 0,
    }; N];
    let mut i = 0;
    while i < N {
        let layer = r.layer();
        let kind = r.kind();
        out[i] = LayerHandle {
            layer,
            kind,
            path: paths[r.number()],
            first_param: r.number(),
            end_param: r.number(),
        };
        i += 1;
    }
    out
}

pub const fn modules<const N: usize>(
    text: &'static str,
    paths: &'static [&'static str],
) -> [ModuleEntry; N] {
    let mut r = Reader::new(text);
    let mut out = [ModuleEntry {
        path: "",
        unit: None,
        node: 0,
        first_handle: 0,
    }; N];
    let mut i = 0;
    while i < N {
        out[i] = ModuleEntry {
            path: paths[r.number()],
            unit: r.option(),
            node: r.number(),
            first_handle: r.number(),
        };
        i += 1;
    }
    out
}

/// Writes tables in the form the readers above read.
#[derive(Default)]
pub struct Writer {
    pub text: String,
}

impl Writer {
    pub fn new() -> Self {
        Writer::default()
    }

    fn separate(&mut self) {
        if !self.text.is_empty() && !self.text.ends_with('\n') {
            self.text.push(' ');
        }
    }

    pub fn number(&mut self, n: impl Into<u64>) {
        self.separate();
        // Formatting by hand: a large model writes hundreds of thousands of
        // numbers, and `fmt` machinery costs several times this.
        let mut n: u64 = n.into();
        let mut digits = [0u8; 20];
        let mut at = digits.len();
        loop {
            at -= 1;
            digits[at] = b'0' + (n % 10) as u8;
            n /= 10;
            if n == 0 {
                break;
            }
        }
        for &d in &digits[at..] {
            self.text.push(d as char);
        }
    }

    pub fn index(&mut self, n: usize) {
        self.number(n as u64);
    }

    pub fn none(&mut self) {
        self.separate();
        self.text.push('-');
    }

    pub fn option(&mut self, n: Option<impl Into<u64>>) {
        match n {
            Some(n) => self.number(n),
            None => self.none(),
        }
    }

    pub fn flag(&mut self, b: bool) {
        self.number(u8::from(b));
    }

    pub fn index_option(&mut self, n: Option<usize>) {
        self.option(n.map(|n| n as u64));
    }

    pub fn end_row(&mut self) {
        self.text.push('\n');
    }

    pub fn kind(&mut self, kind: LayerKind) {
        let code = LayerKind::ALL.iter().position(|&k| k == kind).unwrap_or(0);
        self.index(code);
    }

    pub fn layer(&mut self, layer: LayerRef) {
        match layer {
            LayerRef::Decoder(i) => {
                self.number(0u8);
                self.index(i);
            }
            LayerRef::Mtp { depth, index } => {
                self.number(1u8);
                self.index(depth);
                self.index(index);
            }
        }
    }

    pub fn op(&mut self, op: Op) {
        let layer = |w: &mut Writer, code: u8, layer: LayerRef| {
            w.number(code);
            w.layer(layer);
        };
        match op {
            Op::Embed => self.number(0u8),
            Op::MtpEnter(d) => {
                self.number(1u8);
                self.index(d);
            }
            Op::Layer(l) => layer(self, 2, l),
            Op::MoePrepare(l) => layer(self, 3, l),
            Op::MoeDispatch(l) => layer(self, 4, l),
            Op::MoeExperts(l) => layer(self, 5, l),
            Op::MoeCombine(l) => layer(self, 6, l),
            Op::Mlp(l) => layer(self, 7, l),
            Op::FinalNorm => self.number(8u8),
            Op::Head(d) => {
                self.number(9u8);
                self.index_option(d);
            }
        }
    }

    pub fn unit_shape(&mut self, shape: UnitShape) {
        self.number(match shape {
            UnitShape::Group => 0u8,
            UnitShape::Layer => 1,
            UnitShape::Mtp => 2,
        });
    }

    /// The text with its last newline dropped.
    pub fn finish(mut self) -> String {
        if self.text.ends_with('\n') {
            self.text.pop();
        }
        self.text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leak(text: String) -> &'static str {
        Box::leak(text.into_boxed_str())
    }

    fn leak_slice(items: Vec<usize>) -> &'static [usize] {
        Box::leak(items.into_boxed_slice())
    }

    #[test]
    fn every_code_round_trips() {
        let all_ops = [
            Op::Embed,
            Op::MtpEnter(3),
            Op::Layer(LayerRef::Decoder(12)),
            Op::MoePrepare(LayerRef::Mtp { depth: 1, index: 2 }),
            Op::MoeDispatch(LayerRef::Decoder(0)),
            Op::MoeExperts(LayerRef::Decoder(7)),
            Op::MoeCombine(LayerRef::Decoder(7)),
            Op::Mlp(LayerRef::Mtp { depth: 0, index: 0 }),
            Op::FinalNorm,
            Op::Head(None),
            Op::Head(Some(4)),
        ];
        let mut w = Writer::new();
        for op in all_ops {
            w.op(op);
            w.end_row();
        }
        assert_eq!(ops::<11>(leak(w.finish())), all_ops);

        let owners = [
            Owner::Embedding,
            Owner::Layer(LayerRef::Decoder(5)),
            Owner::Layer(LayerRef::Mtp { depth: 2, index: 1 }),
            Owner::FinalNorm,
            Owner::MtpBlock(1),
            Owner::OutputLayer,
        ];
        // Runs break at a new owner, a gap in definitions or a new bucket.
        let mut params = Vec::new();
        for (i, owner) in owners.into_iter().enumerate() {
            for k in 0..3 {
                params.push(Param {
                    owner,
                    def: i * 10 + k + usize::from(k == 2),
                    bucket: i + usize::from(k == 1),
                    offset: params.len() * 64,
                });
            }
        }
        let (runs, offsets) = param_runs(&params);
        assert_eq!(runs.len() / 6, owners.len() * 3);
        let decoded = super::params::<18>(leak_slice(runs), leak_slice(offsets));
        assert_eq!(decoded.as_slice(), params.as_slice());
        let members = bucket_members::<18, 7>(&decoded);
        let mut expected: Vec<usize> = (0..18).collect();
        expected.sort_by_key(|&i| (params[i].bucket, i));
        assert_eq!(members.as_slice(), expected.as_slice());

        let mut w = Writer::new();
        for kind in LayerKind::ALL {
            w.kind(kind);
        }
        let mut r = Reader::new(leak(w.finish()));
        for kind in LayerKind::ALL {
            assert_eq!(r.kind(), kind);
        }
        assert_eq!(options::<3>("4 - 0"), [Some(4), None, Some(0)]);
    }

    #[test]
    fn lists_are_cut_into_consecutive_windows() {
        static LISTS: [usize; 5] = [0, 1, 2, 3, 4];
        let buckets = buckets::<2>("- 0 10 64 1 2\n3 1 7 7 - 3", &LISTS);
        assert_eq!(buckets[0].params.as_ref(), &[0, 1]);
        assert_eq!(buckets[0].unit, None);
        assert_eq!(buckets[0].megatron_row_lcm, Some(1));
        assert_eq!(buckets[1].params.as_ref(), &[2, 3, 4]);
        assert_eq!(buckets[1].unit, Some(3));
        assert!(buckets[1].expert);
        assert_eq!(buckets[1].megatron_row_lcm, None);
        assert_eq!(buckets[1].id, 1);
    }
}
