//! Parsing the body of one `<tool_call>...</tool_call>` block into a name and JSON arguments.
//!
//! Two forms, told apart by their first character:
//! - Qwen3 / Hermes JSON: `{"name": "f", "arguments": {...}}` (vLLM's `hermes` parser);
//! - Qwen3.5/3.6 and Qwen3-Coder XML: `<function=f>\n<parameter=a>\nVALUE\n</parameter>\n
//!   </function>` (vLLM's `qwen3_coder` parser). The Qwen3.6 template writes string values raw
//!   and everything else through `tojson`, so a value is read back as JSON when it parses and
//!   as a string otherwise; a tool schema saying `"type": "string"` keeps it a string.
//!
//! It must not decide what counts as a tool call in the stream (stream.rs does) and never
//! panics on malformed text: it answers `None` and the caller keeps the text as content.

use std::collections::HashMap;

use serde_json::{Map, Value};

/// A parsed tool call, in the OpenAI shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    /// `call_<n>` or the prefix the stream was given, unique within a stream.
    pub id: String,
    pub name: String,
    /// The arguments as a JSON object in a string (OpenAI's `function.arguments`).
    pub arguments: String,
}

/// Declared parameter types of the tools a request offered, for reading XML values back.
#[derive(Debug, Clone, Default)]
pub struct ToolSchemas {
    /// function name -> parameter name -> whether the schema allows only strings
    string_params: HashMap<String, HashMap<String, bool>>,
}

impl ToolSchemas {
    /// From OpenAI tools: `[{"type": "function", "function": {"name", "parameters"}}]` (a bare
    /// `{"name", "parameters"}` is accepted too).
    pub fn from_tools(tools: &[Value]) -> Self {
        let mut string_params = HashMap::new();
        for tool in tools {
            let f = tool.get("function").unwrap_or(tool);
            let Some(name) = f.get("name").and_then(Value::as_str) else {
                continue;
            };
            let mut params = HashMap::new();
            let props = f
                .get("parameters")
                .and_then(|p| p.get("properties"))
                .and_then(Value::as_object);
            for (pname, schema) in props.into_iter().flatten() {
                let only_string = match schema.get("type") {
                    Some(Value::String(t)) => t == "string",
                    Some(Value::Array(ts)) => ts.iter().all(|t| t.as_str() == Some("string")),
                    _ => false,
                };
                params.insert(pname.clone(), only_string);
            }
            string_params.insert(name.to_string(), params);
        }
        Self { string_params }
    }

    fn is_string(&self, function: &str, param: &str) -> bool {
        self.string_params
            .get(function)
            .and_then(|p| p.get(param))
            .copied()
            .unwrap_or(false)
    }
}

/// Parses a tool-call body (the text between the tags). `closed` says whether `</tool_call>`
/// was seen; without it the XML form must at least end its `</function>`.
pub(crate) fn parse_body(
    body: &str,
    closed: bool,
    schemas: &ToolSchemas,
) -> Option<(String, String)> {
    let body = body.trim();
    if body.starts_with('{') {
        parse_json(body)
    } else if let Some(rest) = body.strip_prefix("<function=") {
        parse_xml(rest, closed, schemas)
    } else {
        None
    }
}

fn parse_json(body: &str) -> Option<(String, String)> {
    let v: Value = serde_json::from_str(body).ok()?;
    let obj = v.as_object()?;
    let name = obj.get("name")?.as_str()?.trim();
    if name.is_empty() {
        return None;
    }
    let args = match obj.get("arguments").or_else(|| obj.get("parameters")) {
        None | Some(Value::Null) => "{}".to_string(),
        Some(Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
    };
    Some((name.to_string(), args))
}

fn parse_xml(rest: &str, closed: bool, schemas: &ToolSchemas) -> Option<(String, String)> {
    let (name, mut params) = rest.split_once('>')?;
    let name = name.trim();
    if name.is_empty() || name.contains(['<', '\n']) {
        return None;
    }
    match params.find("</function>") {
        Some(end) => params = &params[..end],
        None if !closed => return None,
        None => {}
    }
    let mut args = Map::new();
    let mut cursor = params;
    while let Some(start) = cursor.find("<parameter=") {
        let after = &cursor[start + "<parameter=".len()..];
        let (pname, value_and_rest) = after.split_once('>')?;
        let end = [
            value_and_rest.find("</parameter>"),
            value_and_rest.find("<parameter="),
        ]
        .into_iter()
        .flatten()
        .min()
        .unwrap_or(value_and_rest.len());
        let mut value = &value_and_rest[..end];
        value = value.strip_prefix('\n').unwrap_or(value);
        value = value.strip_suffix('\n').unwrap_or(value);
        let pname = pname.trim();
        if pname.is_empty() {
            return None;
        }
        args.insert(
            pname.to_string(),
            read_value(value, schemas.is_string(name, pname)),
        );
        cursor = &value_and_rest[end..];
        cursor = cursor.strip_prefix("</parameter>").unwrap_or(cursor);
    }
    Some((name.to_string(), Value::Object(args).to_string()))
}

/// A parameter value as the Qwen3.6 template wrote it: raw if a string, JSON otherwise.
fn read_value(raw: &str, only_string: bool) -> Value {
    if only_string {
        return Value::String(raw.to_string());
    }
    match serde_json::from_str::<Value>(raw) {
        Ok(v) => v,
        // Qwen3.5's template printed Python booleans (`True`) through `|string`.
        Err(_) if raw == "True" => Value::Bool(true),
        Err(_) if raw == "False" => Value::Bool(false),
        Err(_) if raw == "None" => Value::Null,
        Err(_) => Value::String(raw.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xml_values_read_back_as_json_or_string() {
        let body = "\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=opts>\n{\"unit\": \"C\"}\n</parameter>\n</function>\n";
        let (name, args) = parse_body(body, true, &ToolSchemas::default()).unwrap_or_default();
        assert_eq!(name, "get_weather");
        assert_eq!(args, r#"{"city":"Paris","days":3,"opts":{"unit":"C"}}"#);
    }

    #[test]
    fn string_schema_keeps_numeric_text_a_string() {
        let tools: Vec<Value> = serde_json::from_str(
            r#"[{"type":"function","function":{"name":"f","parameters":{"type":"object","properties":{"zip":{"type":"string"}}}}}]"#,
        )
        .unwrap_or_default();
        let schemas = ToolSchemas::from_tools(&tools);
        let body = "<function=f>\n<parameter=zip>\n02139\n</parameter>\n</function>";
        let (_, args) = parse_body(body, true, &schemas).unwrap_or_default();
        assert_eq!(args, r#"{"zip":"02139"}"#);
    }

    #[test]
    fn json_form_and_malformed_bodies() {
        let (n, a) = parse_body(
            "\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n",
            true,
            &ToolSchemas::default(),
        )
        .unwrap_or_default();
        assert_eq!((n.as_str(), a.as_str()), ("f", r#"{"x":1}"#));
        assert!(
            parse_body(
                "{\"name\": \"f\", \"arguments\": {\"x\": 1}",
                true,
                &ToolSchemas::default()
            )
            .is_none()
        );
        assert!(parse_body("call f(x)", true, &ToolSchemas::default()).is_none());
        assert!(
            parse_body(
                "<function=f>\n<parameter=a>\n1",
                false,
                &ToolSchemas::default()
            )
            .is_none()
        );
    }
}
