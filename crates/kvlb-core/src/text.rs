//! A configuration value read from TOML as the text a flag would carry: a string, a number or
//! a boolean becomes its text, then goes through the type's `FromStr`, so a flag and its file
//! key share one parser and one error (`"value": why`).

#![forbid(unsafe_code)]

use serde::de::{self, Deserializer, Visitor};
use std::str::FromStr;

/// Reads a scalar value as the text a flag would carry.
struct Text;

impl<'de> Visitor<'de> for Text {
    type Value = String;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a string, a number or true/false")
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<String, E> {
        Ok(v.to_string())
    }
    fn visit_string<E: de::Error>(self, v: String) -> Result<String, E> {
        Ok(v)
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<String, E> {
        Ok(v.to_string())
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<String, E> {
        Ok(v.to_string())
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<String, E> {
        Ok(v.to_string())
    }
    fn visit_bool<E: de::Error>(self, v: bool) -> Result<String, E> {
        Ok(v.to_string())
    }
}

/// A file value through the type's `FromStr`: `"value": why` on error.
pub fn from_text<'de, D: Deserializer<'de>, T: FromStr<Err = String>>(d: D) -> Result<T, D::Error> {
    let text = d.deserialize_any(Text)?;
    text.parse()
        .map_err(|why: String| de::Error::custom(format!("{text:?}: {why}")))
}
