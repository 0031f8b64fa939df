//! Python's `json.dumps`, for the chat template `tojson` filter.
//!
//! transformers replaces Jinja's `tojson` (which HTML-escapes) with
//! `json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`, and
//! tool schemas reach the prompt through it, so every byte matters: `", "` and `": "`
//! separators, insertion key order, Python float repr (`1e-05`, `1e+16`, `1.0`), and only
//! control characters escaped. It must not be used for wire JSON (serde_json does that).

use minijinja::value::ValueKind;
use minijinja::{Error, ErrorKind, Value};

/// Options of `json.dumps` a template may pass.
#[derive(Debug, Clone)]
pub(crate) struct DumpOptions {
    pub ensure_ascii: bool,
    /// `None`: one line. `Some(s)`: newline and `s` repeated per level.
    pub indent: Option<String>,
    pub item_sep: String,
    pub key_sep: String,
    pub sort_keys: bool,
}

impl Default for DumpOptions {
    fn default() -> Self {
        Self {
            ensure_ascii: false,
            indent: None,
            item_sep: ", ".into(),
            key_sep: ": ".into(),
            sort_keys: false,
        }
    }
}

impl DumpOptions {
    /// Python picks `(",", ": ")` as default separators once `indent` is set.
    pub fn with_indent(mut self, indent: Option<String>) -> Self {
        if indent.is_some() {
            self.item_sep = ",".into();
        }
        self.indent = indent;
        self
    }
}

/// `json.dumps(value, **opts)`.
pub(crate) fn dumps(value: &Value, opts: &DumpOptions) -> Result<String, Error> {
    let mut out = String::new();
    write_value(&mut out, value, opts, 0)?;
    Ok(out)
}

fn write_value(out: &mut String, v: &Value, opts: &DumpOptions, level: usize) -> Result<(), Error> {
    match v.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => write_number(out, v)?,
        ValueKind::String => write_string(out, v.as_str().unwrap_or_default(), opts.ensure_ascii),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            write_container(out, opts, level, ('[', ']'), items.len(), |out, i| {
                write_value(out, &items[i], opts, level + 1)
            })?;
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if opts.sort_keys {
                keys.sort_by_key(|k| k.to_string());
            }
            write_container(out, opts, level, ('{', '}'), keys.len(), |out, i| {
                let key = &keys[i];
                match key.as_str() {
                    Some(s) => write_string(out, s, opts.ensure_ascii),
                    // Python turns int/float/bool/None keys into strings.
                    None => write_string(out, &python_key(key), opts.ensure_ascii),
                }
                out.push_str(&opts.key_sep);
                write_value(out, &v.get_item(key)?, opts, level + 1)
            })?;
        }
        kind => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("Object of type {kind} is not JSON serializable"),
            ));
        }
    }
    Ok(())
}

fn write_container(
    out: &mut String,
    opts: &DumpOptions,
    level: usize,
    (open, close): (char, char),
    len: usize,
    mut item: impl FnMut(&mut String, usize) -> Result<(), Error>,
) -> Result<(), Error> {
    out.push(open);
    if len == 0 {
        out.push(close);
        return Ok(());
    }
    for i in 0..len {
        if i > 0 {
            out.push_str(&opts.item_sep);
        }
        if let Some(ind) = &opts.indent {
            out.push('\n');
            out.push_str(&ind.repeat(level + 1));
        }
        item(out, i)?;
    }
    if let Some(ind) = &opts.indent {
        out.push('\n');
        out.push_str(&ind.repeat(level));
    }
    out.push(close);
    Ok(())
}

fn python_key(key: &Value) -> String {
    match key.kind() {
        ValueKind::None => "null".into(),
        ValueKind::Bool => if key.is_true() { "true" } else { "false" }.into(),
        ValueKind::Number if !key.is_integer() => {
            f64::try_from(key.clone()).map_or_else(|_| key.to_string(), python_float)
        }
        _ => key.to_string(),
    }
}

fn write_number(out: &mut String, v: &Value) -> Result<(), Error> {
    if v.is_integer() {
        out.push_str(&v.to_string());
        return Ok(());
    }
    let f = f64::try_from(v.clone())?;
    out.push_str(&python_float(f));
    Ok(())
}

/// Python's `float.__repr__` as `json.dumps` prints it: shortest round-trip digits, decimal
/// notation for exponents -4..16, otherwise `d.ddde+XX`.
pub(crate) fn python_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    // `{:e}` gives the shortest round-trip digits: "-1.2345e-7", "1e16".
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if (-4..16).contains(&exp) {
        let point = exp + 1; // digits before the decimal point
        let body = if point <= 0 {
            format!("0.{}{digits}", "0".repeat(point.unsigned_abs() as usize))
        } else if point as usize >= digits.len() {
            format!("{digits}{}.0", "0".repeat(point as usize - digits.len()))
        } else {
            let (a, b) = digits.split_at(point as usize);
            format!("{a}.{b}")
        };
        format!("{sign}{body}")
    } else {
        let (first, rest) = digits.split_at(1);
        let frac = if rest.is_empty() {
            String::new()
        } else {
            format!(".{rest}")
        };
        let esign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{first}{frac}e{esign}{:02}", exp.unsigned_abs())
    }
}

/// `json.encoder.py_encode_basestring` (and the ASCII variant).
fn write_string(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c if ensure_ascii && (c as u32) > 0x7e => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_print_like_python_repr() {
        let cases = [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (-2.5, "-2.5"),
            (1e-5, "1e-05"),
            (0.0001, "0.0001"),
            (1e16, "1e+16"),
            (123456789012345.0, "123456789012345.0"),
            (1.5e300, "1.5e+300"),
            (0.0, "0.0"),
        ];
        for (f, want) in cases {
            assert_eq!(python_float(f), want, "{f}");
        }
    }

    #[test]
    fn dumps_matches_python_separators_and_escapes() {
        let v: Value = serde_json::from_str::<Value>(r#"{"b": [1, 2.0, "é\n\u0001"], "a": {}}"#)
            .unwrap_or_default();
        let got = dumps(&v, &DumpOptions::default()).unwrap_or_default();
        assert_eq!(got, "{\"b\": [1, 2.0, \"é\\n\\u0001\"], \"a\": {}}");
        let opts = DumpOptions::default().with_indent(Some("  ".into()));
        let got = dumps(&v, &opts).unwrap_or_default();
        assert_eq!(
            got,
            "{\n  \"b\": [\n    1,\n    2.0,\n    \"é\\n\\u0001\"\n  ],\n  \"a\": {}\n}"
        );
    }
}
