//! Streaming detokenization: generated ids in, typed text events out, for the CLI and server.
//!
//! Three stages, each holding back only what it must:
//! 1. bytes: each id's raw bytes (byte-level BPE splits an emoji over several ids) are joined
//!    and only whole UTF-8 characters go on; invalid bytes become U+FFFD as in HF's decode;
//! 2. stop strings: text that could still be the start of a stop string waits until ruled out;
//!    on a match the text before it goes on and the stream ends with `Stopped`;
//! 3. tags: `<think>...</think>` becomes `Reasoning`, `<tool_call>...</tool_call>` becomes a
//!    `ToolCall` (tool_parse.rs), the rest `Content`. A partial tag or an open tool call is held
//!    back; a tool call that does not parse is given back as content, never dropped. Newlines
//!    between a tag and the text next to it are dropped, as the Qwen templates write them.
//!
//! Mirrors mlx-lm's streaming detokenizer (stage 1), OpenAI `stop` semantics (stage 2) and
//! vLLM's `qwen3` reasoning and `hermes` / `qwen3_coder` tool parsers (stage 3). It must not
//! sample, count tokens against limits or know about HTTP.

use std::sync::Arc;

use super::tokenizer::Tokenizer;
use super::tool_parse::{self, ToolCall, ToolSchemas};

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";
const CALL_OPEN: &str = "<tool_call>";
const CALL_CLOSE: &str = "</tool_call>";

/// What the stream tells its consumer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamEvent {
    /// Answer text.
    Content(String),
    /// Thinking text (inside `<think>...</think>`).
    Reasoning(String),
    /// A complete tool call.
    ToolCall(ToolCall),
    /// Generation should stop; nothing follows.
    Stopped(StopReason),
}

/// Why a stream stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopReason {
    /// A stop string appeared; the text before it was emitted, the string itself was not.
    StopString(String),
    /// A stop id (EOS) was pushed.
    StopToken(u32),
}

/// How a stream interprets the text.
#[derive(Debug, Clone)]
pub struct StreamOptions {
    /// Strings that end generation (OpenAI `stop`).
    pub stop_strings: Vec<String>,
    /// Ids that end generation (the EOS set from `GenerationConfig::stop_ids`).
    pub stop_ids: Vec<u32>,
    /// The prompt already opened `<think>` (Qwen3.5/3.6 by default; see
    /// [`prompt_opens_reasoning`]), so the first text is reasoning.
    pub starts_in_reasoning: bool,
    /// Split `<think>` blocks out as `Reasoning`; off: they stay in the content.
    pub parse_reasoning: bool,
    /// Parse `<tool_call>` blocks; off: they stay in the content.
    pub parse_tool_calls: bool,
    /// Drop the text of added tokens marked special (`<|im_end|>`, `<|endoftext|>`).
    pub skip_special: bool,
    /// Parameter types of the offered tools (keeps `"02139"` a string for a string param).
    pub tools: ToolSchemas,
    /// Tool-call ids are this prefix and a counter: `call_0`, `call_1`, ...
    pub tool_call_id_prefix: String,
}

impl Default for StreamOptions {
    fn default() -> Self {
        Self {
            stop_strings: Vec::new(),
            stop_ids: Vec::new(),
            starts_in_reasoning: false,
            parse_reasoning: true,
            parse_tool_calls: true,
            skip_special: true,
            tools: ToolSchemas::default(),
            tool_call_id_prefix: "call_".into(),
        }
    }
}

/// Whether a rendered prompt leaves generation inside a `<think>` block: its last `<think>` is
/// followed only by whitespace (Qwen3.5/3.6's default generation prompt `<think>\n`), not by
/// `</think>` (the `enable_thinking=false` prompt `<think>\n\n</think>\n\n`).
pub fn prompt_opens_reasoning(prompt: &str) -> bool {
    match prompt.rfind(THINK_OPEN) {
        Some(i) => prompt[i + THINK_OPEN.len()..].trim().is_empty(),
        None => false,
    }
}

/// Turns generated ids into [`StreamEvent`]s.
#[derive(Debug)]
pub struct TextStream {
    tok: Arc<Tokenizer>,
    stop_strings: Vec<String>,
    stop_ids: Vec<u32>,
    skip_special: bool,
    utf8: Vec<u8>,    // bytes of a character not yet complete (at most 3)
    stop_buf: String, // text that may still begin a stop string
    parser: TagParser,
    done: bool,
}

impl TextStream {
    /// A stream over `tok`'s vocabulary.
    pub fn new(tok: Arc<Tokenizer>, opts: StreamOptions) -> Self {
        let parser = TagParser {
            mode: if opts.starts_in_reasoning && opts.parse_reasoning {
                Mode::Reasoning
            } else {
                Mode::Content
            },
            pending: String::new(),
            call_body: String::new(),
            strip_newlines: opts.starts_in_reasoning,
            parse_reasoning: opts.parse_reasoning,
            parse_tool_calls: opts.parse_tool_calls,
            schemas: opts.tools,
            id_prefix: opts.tool_call_id_prefix,
            calls: 0,
        };
        Self {
            tok,
            stop_strings: opts
                .stop_strings
                .into_iter()
                .filter(|s| !s.is_empty())
                .collect(),
            stop_ids: opts.stop_ids,
            skip_special: opts.skip_special,
            utf8: Vec::with_capacity(8),
            stop_buf: String::new(),
            parser,
            done: false,
        }
    }

    /// Whether the stream has ended (a stop id or string, or `finish`).
    pub fn is_done(&self) -> bool {
        self.done
    }

    /// Feeds one generated id.
    pub fn push(&mut self, id: u32) -> Vec<StreamEvent> {
        let mut events = Vec::new();
        if self.done {
            return events;
        }
        if self.stop_ids.contains(&id) {
            self.flush(&mut events);
            events.push(StreamEvent::Stopped(StopReason::StopToken(id)));
            return events;
        }
        if self.skip_special && self.tok.is_special(id) {
            return events;
        }
        self.utf8.extend_from_slice(self.tok.token_bytes(id));
        let text = take_complete_utf8(&mut self.utf8);
        if !text.is_empty() {
            self.feed_text(&text, &mut events);
        }
        events
    }

    /// Ends the stream: whatever was held back (a partial character, a possible stop-string
    /// prefix, a partial tag, an unfinished tool call) is given out.
    pub fn finish(&mut self) -> Vec<StreamEvent> {
        let mut events = Vec::new();
        if !self.done {
            self.flush(&mut events);
        }
        events
    }

    fn flush(&mut self, events: &mut Vec<StreamEvent>) {
        if !self.utf8.is_empty() {
            self.utf8.clear();
            self.stop_buf.push('\u{fffd}');
        }
        let rest = std::mem::take(&mut self.stop_buf);
        self.parser.feed(&rest, events);
        self.parser.finish(events);
        self.done = true;
    }

    fn feed_text(&mut self, text: &str, events: &mut Vec<StreamEvent>) {
        if self.stop_strings.is_empty() {
            self.parser.feed(text, events);
            return;
        }
        self.stop_buf.push_str(text);
        let hit = self
            .stop_strings
            .iter()
            .filter_map(|s| self.stop_buf.find(s.as_str()).map(|pos| (pos, s)))
            .min_by_key(|(pos, _)| *pos);
        if let Some((pos, s)) = hit {
            let reason = StopReason::StopString(s.clone());
            let before = self.stop_buf[..pos].to_string();
            self.stop_buf.clear();
            self.parser.feed(&before, events);
            self.parser.finish(events);
            events.push(StreamEvent::Stopped(reason));
            self.done = true;
            return;
        }
        let hold = self
            .stop_strings
            .iter()
            .map(|s| partial_suffix(&self.stop_buf, s))
            .max()
            .unwrap_or(0);
        let cut = self.stop_buf.len() - hold;
        if cut > 0 {
            let ready: String = self.stop_buf.drain(..cut).collect();
            self.parser.feed(&ready, events);
        }
    }
}

/// Moves the complete UTF-8 characters out of `buf`, leaving an unfinished one; bytes that can
/// never start a valid character become U+FFFD.
fn take_complete_utf8(buf: &mut Vec<u8>) -> String {
    let mut out = String::new();
    let mut start = 0;
    loop {
        match std::str::from_utf8(&buf[start..]) {
            Ok(s) => {
                out.push_str(s);
                start = buf.len();
                break;
            }
            Err(e) => {
                let valid = start + e.valid_up_to();
                out.push_str(std::str::from_utf8(&buf[start..valid]).unwrap_or_default());
                match e.error_len() {
                    Some(bad) => {
                        out.push('\u{fffd}');
                        start = valid + bad;
                    }
                    None => {
                        start = valid;
                        break;
                    }
                }
            }
        }
    }
    buf.drain(..start);
    out
}

/// Length of the longest proper prefix of `pat` that `text` ends with.
fn partial_suffix(text: &str, pat: &str) -> usize {
    let t = text.as_bytes();
    let p = pat.as_bytes();
    (1..p.len().min(t.len() + 1))
        .rev()
        .find(|&k| t.ends_with(&p[..k]) && text.is_char_boundary(t.len() - k))
        .unwrap_or(0)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Content,
    Reasoning,
    ToolCall,
}

/// Stage 3: splits released text on the think and tool-call tags.
#[derive(Debug)]
struct TagParser {
    mode: Mode,
    pending: String,   // text not yet classified (a tag may be starting)
    call_body: String, // body of the open tool call
    strip_newlines: bool,
    parse_reasoning: bool,
    parse_tool_calls: bool,
    schemas: ToolSchemas,
    id_prefix: String,
    calls: usize,
}

impl TagParser {
    fn feed(&mut self, text: &str, events: &mut Vec<StreamEvent>) {
        if self.mode == Mode::ToolCall {
            self.call_body.push_str(text);
        } else {
            self.pending.push_str(text);
        }
        while self.step(events) {}
    }

    /// Handles one tag if a whole one is buffered; returns whether to go on.
    fn step(&mut self, events: &mut Vec<StreamEvent>) -> bool {
        match self.mode {
            Mode::ToolCall => self.step_call(events),
            Mode::Content | Mode::Reasoning => self.step_text(events),
        }
    }

    /// Inside `<tool_call>`: wait for `</tool_call>`, then parse the body.
    fn step_call(&mut self, events: &mut Vec<StreamEvent>) -> bool {
        let Some(end) = self.call_body.find(CALL_CLOSE) else {
            return false;
        };
        let rest = self.call_body.split_off(end + CALL_CLOSE.len());
        let body = std::mem::take(&mut self.call_body);
        self.emit_call(&body[..end], true, events);
        self.mode = Mode::Content;
        self.strip_newlines = true;
        self.pending = rest;
        true
    }

    /// In content or reasoning: emit text up to the next tag, or up to what might begin one.
    fn step_text(&mut self, events: &mut Vec<StreamEvent>) -> bool {
        if self.strip_newlines {
            let trimmed = self.pending.trim_start_matches('\n');
            if trimmed.is_empty() {
                self.pending.clear();
                return false;
            }
            self.pending = trimmed.to_string();
            self.strip_newlines = false;
        }
        let tags = self.tags();
        let hit = tags
            .iter()
            .filter_map(|t| self.pending.find(t).map(|p| (p, *t)))
            .min_by_key(|(p, _)| *p);
        let Some((pos, tag)) = hit else {
            // Hold back a possible partial tag and the newlines before it.
            let tag_hold = tags
                .iter()
                .map(|t| partial_suffix(&self.pending, t))
                .max()
                .unwrap_or(0);
            let body = &self.pending[..self.pending.len() - tag_hold];
            let cut = body.trim_end_matches('\n').len();
            if cut > 0 {
                let ready: String = self.pending.drain(..cut).collect();
                self.emit_text(&ready, events);
            }
            return false;
        };
        let rest = self.pending.split_off(pos + tag.len());
        let before = std::mem::replace(&mut self.pending, rest);
        self.emit_text(before[..pos].trim_end_matches('\n'), events);
        self.mode = match tag {
            THINK_OPEN => Mode::Reasoning,
            CALL_OPEN => Mode::ToolCall,
            _ => Mode::Content,
        };
        if self.mode == Mode::ToolCall {
            self.call_body = std::mem::take(&mut self.pending);
        } else {
            self.strip_newlines = true;
        }
        true
    }

    /// The tags that end the current mode's text.
    fn tags(&self) -> &'static [&'static str] {
        match (self.mode, self.parse_reasoning, self.parse_tool_calls) {
            (Mode::Reasoning, _, _) => &[THINK_CLOSE],
            (_, true, true) => &[THINK_OPEN, CALL_OPEN],
            (_, true, false) => &[THINK_OPEN],
            (_, false, true) => &[CALL_OPEN],
            (_, false, false) => &[],
        }
    }

    fn finish(&mut self, events: &mut Vec<StreamEvent>) {
        match self.mode {
            Mode::ToolCall => {
                let body = std::mem::take(&mut self.call_body);
                self.emit_call(&body, false, events);
            }
            Mode::Content | Mode::Reasoning => {
                let rest = std::mem::take(&mut self.pending);
                self.emit_text(&rest, events);
            }
        }
        self.mode = Mode::Content;
    }

    fn emit_text(&self, text: &str, events: &mut Vec<StreamEvent>) {
        if text.is_empty() {
            return;
        }
        let text = text.to_string();
        events.push(match self.mode {
            Mode::Reasoning => StreamEvent::Reasoning(text),
            _ => StreamEvent::Content(text),
        });
    }

    fn emit_call(&mut self, body: &str, closed: bool, events: &mut Vec<StreamEvent>) {
        match tool_parse::parse_body(body, closed, &self.schemas) {
            Some((name, arguments)) => {
                let id = format!("{}{}", self.id_prefix, self.calls);
                self.calls += 1;
                events.push(StreamEvent::ToolCall(ToolCall {
                    id,
                    name,
                    arguments,
                }));
            }
            None => {
                let close = if closed { CALL_CLOSE } else { "" };
                events.push(StreamEvent::Content(format!("{CALL_OPEN}{body}{close}")));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utf8_assembly_holds_partial_characters() {
        let mut buf = "a".as_bytes().to_vec();
        buf.extend_from_slice(&"😀".as_bytes()[..2]);
        assert_eq!(take_complete_utf8(&mut buf), "a");
        assert_eq!(buf.len(), 2);
        buf.extend_from_slice(&"😀".as_bytes()[2..]);
        assert_eq!(take_complete_utf8(&mut buf), "😀");
        let mut bad = vec![0xff, b'x'];
        assert_eq!(take_complete_utf8(&mut bad), "\u{fffd}x");
    }

    #[test]
    fn partial_suffix_finds_longest_prefix() {
        assert_eq!(partial_suffix("abc<tool", "<tool_call>"), 5);
        assert_eq!(partial_suffix("abc", "<tool_call>"), 0);
        assert_eq!(partial_suffix("xx<", "<"), 0); // whole match is not a partial
    }

    #[test]
    fn prompt_think_detection() {
        assert!(prompt_opens_reasoning("<|im_start|>assistant\n<think>\n"));
        assert!(!prompt_opens_reasoning(
            "<|im_start|>assistant\n<think>\n\n</think>\n\n"
        ));
        assert!(!prompt_opens_reasoning("<|im_start|>assistant\n"));
    }
}
