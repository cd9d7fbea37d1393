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
            line: before.matches('\n').count() + 1,
            column: before[line_start..].chars().count() + 1,
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
}
