//! Chat messages in the OpenAI shape, and how they are handed to a chat template.
//!
//! Owns the serde types (`Message`, `Content`, tool calls) and their conversion to the plain
//! JSON a template sees. It must not render anything. The conversion mirrors vLLM's
//! `_postprocess_messages`: tool-call `arguments` given as a JSON string (the OpenAI wire form)
//! are parsed into an object, because the Qwen3.5/3.6 templates iterate them with `|items`,
//! and transformers expects them as dicts.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// One chat turn.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Message {
    /// `system`, `user`, `assistant` or `tool` (templates decide what else they accept).
    pub role: String,
    /// Text, or a list of OpenAI content parts; `None` for an assistant turn that only calls
    /// tools.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<Content>,
    /// The thinking of an earlier assistant turn, kept apart from `content`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// Tool calls an assistant turn made.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<MessageToolCall>,
    /// For a `tool` turn: which call this is the result of.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// Optional participant or tool name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// Message content: a plain string or OpenAI content parts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

/// One OpenAI content part, e.g. `{"type": "text", "text": "..."}`. Other kinds (images) keep
/// their fields so a template can see them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// A tool call recorded in an assistant turn (OpenAI shape).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MessageToolCall {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// Always `"function"` in OpenAI's API.
    #[serde(rename = "type", default = "function_kind")]
    pub kind: String,
    pub function: FunctionCall,
}

/// The function part of a tool call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FunctionCall {
    pub name: String,
    /// A JSON object, or a string holding one (the OpenAI wire form).
    #[serde(default)]
    pub arguments: Value,
}

fn function_kind() -> String {
    "function".to_string()
}

impl Message {
    /// A message with string content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: Some(Content::Text(content.into())),
            reasoning_content: None,
            tool_calls: Vec::new(),
            tool_call_id: None,
            name: None,
        }
    }

    /// The plain text of the content (parts joined), or `""`.
    pub fn text(&self) -> String {
        match &self.content {
            None => String::new(),
            Some(Content::Text(s)) => s.clone(),
            Some(Content::Parts(parts)) => parts.iter().filter_map(|p| p.text.as_deref()).collect(),
        }
    }

    /// The JSON object a template sees for this message.
    pub(crate) fn to_template_value(&self) -> Value {
        let mut v = serde_json::to_value(self).unwrap_or(Value::Null);
        if let Some(calls) = v.get_mut("tool_calls").and_then(Value::as_array_mut) {
            for call in calls {
                if let Some(f) = call.get_mut("function").and_then(Value::as_object_mut) {
                    normalize_arguments(f);
                }
            }
        }
        v
    }
}

/// Empty or missing arguments become `{}`; a string that parses as JSON becomes that value; a
/// string that does not parse is left alone for the template to deal with.
fn normalize_arguments(function: &mut Map<String, Value>) {
    let args = function.entry("arguments").or_insert(Value::Null);
    match args {
        Value::Null => *args = Value::Object(Map::new()),
        Value::String(s) if s.trim().is_empty() => *args = Value::Object(Map::new()),
        Value::String(s) => {
            if let Ok(parsed) = serde_json::from_str::<Value>(s) {
                *args = parsed;
            }
        }
        _ => {}
    }
}
