//! A YAML tree that remembers the line of every node.
//!
//! serde-based loaders stop at the first problem and forget positions once a value is built;
//! rule files must report every problem with its line, so the loader walks this tree by hand.

use std::borrow::Cow;
use std::collections::HashMap;

use granit_parser::{Event, Parser, ScalarStyle};

/// One YAML node and where it starts.
#[derive(Debug, Clone, PartialEq)]
pub struct Node {
    /// The 1-based line.
    pub line: usize,
    /// The value.
    pub value: Value,
}

/// A YAML value; scalars stay text until the loader knows what type it wants.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// A scalar; `plain` when written without quotes or block style, so `true` or `3` may be
    /// read as a boolean or a number while `"3"` stays text.
    Scalar {
        /// The text after escape processing.
        text: String,
        /// Written unquoted.
        plain: bool,
    },
    /// A sequence.
    Seq(Vec<Node>),
    /// A mapping, in file order, duplicates kept so the loader can report them.
    Map(Vec<(Node, Node)>),
}

impl Node {
    /// True for an empty plain scalar, `~` or `null`.
    pub fn is_null(&self) -> bool {
        matches!(&self.value, Value::Scalar { text, plain: true } if matches!(text.as_str(), "" | "~" | "null" | "Null" | "NULL"))
    }

    /// A short name for the node's type, for messages.
    pub fn type_name(&self) -> &'static str {
        match &self.value {
            _ if self.is_null() => "nothing",
            Value::Scalar { .. } => "a scalar",
            Value::Seq(_) => "a list",
            Value::Map(_) => "a mapping",
        }
    }
}

/// A syntax error and its line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyntaxError {
    /// The 1-based line.
    pub line: usize,
    /// What the parser said.
    pub message: String,
}

enum Frame {
    Seq(usize, Vec<Node>, usize),
    Map(usize, Vec<(Node, Node)>, Option<Node>, usize),
}

/// Parses every document in `text`; documents that are empty are skipped.
pub fn parse(text: &str) -> Result<Vec<Node>, SyntaxError> {
    let mut parser = Parser::new_from_str(text);
    let mut docs = Vec::new();
    let mut stack: Vec<Frame> = Vec::new();
    let mut anchors: HashMap<usize, Node> = HashMap::new();
    while let Some(next) = parser.next_event() {
        let (event, span) = next.map_err(|e| SyntaxError { line: e.marker().line(), message: e.info() })?;
        let line = span.start.line();
        let (node, anchor) = match event {
            Event::Scalar(text, style, anchor, _tag) => {
                let plain = matches!(style, ScalarStyle::Plain);
                (Node { line, value: Value::Scalar { text: Cow::into_owned(text), plain } }, anchor)
            }
            Event::Alias(id) => match anchors.get(&id) {
                Some(node) => (Node { line, ..node.clone() }, 0),
                None => return Err(SyntaxError { line, message: "alias to an unknown anchor".into() }),
            },
            Event::SequenceStart(_, anchor, _) => {
                stack.push(Frame::Seq(line, Vec::new(), anchor));
                continue;
            }
            Event::MappingStart(_, anchor, _) => {
                stack.push(Frame::Map(line, Vec::new(), None, anchor));
                continue;
            }
            Event::SequenceEnd => match stack.pop() {
                Some(Frame::Seq(l, items, anchor)) => (Node { line: l, value: Value::Seq(items) }, anchor),
                _ => return Err(SyntaxError { line, message: "unbalanced sequence".into() }),
            },
            Event::MappingEnd => match stack.pop() {
                Some(Frame::Map(l, entries, None, anchor)) => (Node { line: l, value: Value::Map(entries) }, anchor),
                _ => return Err(SyntaxError { line, message: "unbalanced mapping".into() }),
            },
            // Stream and document markers, comments and anchor metadata carry no data.
            _ => continue,
        };
        if anchor != 0 {
            anchors.insert(anchor, node.clone());
        }
        match stack.last_mut() {
            None => {
                if !node.is_null() {
                    docs.push(node);
                }
                anchors.clear();
            }
            Some(Frame::Seq(_, items, _)) => items.push(node),
            Some(Frame::Map(_, entries, pending, _)) => match pending.take() {
                None => *pending = Some(node),
                Some(key) => entries.push((key, node)),
            },
        }
    }
    Ok(docs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_lines_and_quoting() {
        let docs = parse("a: 1\nb:\n  - x\n  - \"3\"\n---\nc: true\n").unwrap();
        assert_eq!(docs.len(), 2);
        let Value::Map(entries) = &docs[0].value else { panic!("mapping expected") };
        assert_eq!(entries[1].0.line, 2);
        let Value::Seq(items) = &entries[1].1.value else { panic!("list expected") };
        assert_eq!(items[1].line, 4);
        assert_eq!(items[1].value, Value::Scalar { text: "3".into(), plain: false });
        assert_eq!(docs[1].line, 6);
    }

    #[test]
    fn resolves_aliases_and_reports_syntax_lines() {
        let docs = parse("a: &x [1, 2]\nb: *x\n").unwrap();
        let Value::Map(entries) = &docs[0].value else { panic!("mapping expected") };
        assert_eq!(entries[0].1.value, entries[1].1.value);
        let err = parse("a: 1\nb: [1, 2\nc: 3\n").unwrap_err();
        assert!(err.line >= 2, "{err:?}");
    }
}
