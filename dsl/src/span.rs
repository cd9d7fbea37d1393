//! Byte spans into a source text, and their 1-based line:column positions.

use serde::{Deserialize, Serialize};

/// A half-open byte range `[start, end)` into the text a value was parsed from.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
pub struct Span {
    pub start: usize,
    pub end: usize,
}

impl Span {
    pub const fn new(start: usize, end: usize) -> Self {
        Span { start, end }
    }

    /// The smallest span covering both.
    pub fn to(self, other: Span) -> Span {
        Span::new(self.start.min(other.start), self.end.max(other.end))
    }

    pub fn len(self) -> usize {
        self.end - self.start
    }

    pub fn is_empty(self) -> bool {
        self.start == self.end
    }

    /// 1-based line and column of the span's start in `source`. Columns count
    /// characters, not bytes, so a caret lands under the right symbol even after
    /// non-ASCII text.
    pub fn line_col(self, source: &str) -> LineCol {
        LineCol::of(source, self.start)
    }
}

/// A 1-based position in a text, as editors and compilers print it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct LineCol {
    pub line: usize,
    pub column: usize,
}

impl LineCol {
    /// The position of byte offset `offset` (clamped to the text, and moved back
    /// to a character boundary) in `source`.
    pub fn of(source: &str, offset: usize) -> LineCol {
        let mut offset = offset.min(source.len());
        while !source.is_char_boundary(offset) {
            offset -= 1;
        }
        let before = &source[..offset];
        let line_start = before.rfind('\n').map_or(0, |i| i + 1);
        LineCol {
            line: before.bytes().filter(|&b| b == b'\n').count() + 1,
            column: before[line_start..].chars().count() + 1,
        }
    }
}

/// Line:column lookups into one text, each costing at most a few hundred
/// bytes of scanning however long the text is. [`LineCol::of`] scans from the
/// start, so asking it about every error of a long pattern (one per `]` of a
/// 10 MB line) would take time quadratic in the text's length.
#[derive(Clone, Debug)]
pub struct LineIndex<'s> {
    source: &'s str,
    /// The position of the first character at or after every multiple of
    /// [`LineIndex::STRIDE`] bytes: `(byte offset, position)`, ascending.
    checkpoints: Vec<(usize, LineCol)>,
}

impl<'s> LineIndex<'s> {
    /// Bytes between checkpoints: the most a lookup scans.
    const STRIDE: usize = 256;

    /// One pass over `source`.
    pub fn new(source: &'s str) -> Self {
        let mut checkpoints = Vec::with_capacity(source.len() / Self::STRIDE + 1);
        let mut here = LineCol { line: 1, column: 1 };
        let mut next = 0;
        for (offset, c) in source.char_indices() {
            if offset >= next {
                checkpoints.push((offset, here));
                next = (offset / Self::STRIDE + 1) * Self::STRIDE;
            }
            here = here.after(c);
        }
        LineIndex {
            source,
            checkpoints,
        }
    }

    /// The same as [`LineCol::of`] on the indexed text.
    pub fn line_col(&self, offset: usize) -> LineCol {
        let source = self.source;
        let mut offset = offset.min(source.len());
        while !source.is_char_boundary(offset) {
            offset -= 1;
        }
        let before = self.checkpoints.partition_point(|&(at, _)| at <= offset);
        let (from, mut here) = match before.checked_sub(1) {
            Some(i) => self.checkpoints[i],
            None => (0, LineCol { line: 1, column: 1 }),
        };
        for c in source[from..offset].chars() {
            here = here.after(c);
        }
        here
    }
}

impl LineCol {
    /// The position just after character `c` written here.
    fn after(self, c: char) -> LineCol {
        if c == '\n' {
            LineCol {
                line: self.line + 1,
                column: 1,
            }
        } else {
            LineCol {
                line: self.line,
                column: self.column + 1,
            }
        }
    }
}

impl std::fmt::Display for LineCol {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.line, self.column)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_count_characters() {
        let src = "Mé\n*x";
        assert_eq!(LineCol::of(src, 0), LineCol { line: 1, column: 1 });
        assert_eq!(LineCol::of(src, 1), LineCol { line: 1, column: 2 });
        // 'é' is two bytes; the newline after it is column 3.
        assert_eq!(LineCol::of(src, 3), LineCol { line: 1, column: 3 });
        assert_eq!(LineCol::of(src, 5), LineCol { line: 2, column: 2 });
        // Inside a multi-byte character: snaps back to its start.
        assert_eq!(LineCol::of(src, 2), LineCol { line: 1, column: 2 });
        assert_eq!(LineCol::of(src, 99), LineCol { line: 2, column: 3 });
    }

    proptest::proptest! {
        /// The index answers exactly as the plain scan, at every offset
        /// (inside characters and past the end included), across checkpoints.
        #[test]
        fn line_index_agrees_with_the_plain_scan(
            source in "[a\n\té\u{1F600}]{0,40}|[M\n]{200,700}|[é\n]{100,400}",
            offsets in proptest::collection::vec(0usize..1500, 1..20),
        ) {
            let index = LineIndex::new(&source);
            for offset in offsets.into_iter().chain([0, source.len()]) {
                proptest::prop_assert_eq!(index.line_col(offset), LineCol::of(&source, offset));
            }
        }
    }
}
