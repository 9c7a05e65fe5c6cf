//! RoPE from a `config.json`: `rope_parameters` or `rope_scaling` (and the old `type`), its theta and
//! its scaling, every parameter read as transformers reads it or refused by name.

use super::keys::rope_keys;
use super::Reader;
use crate::error::Result;
use crate::model::rope::{yarn_mscale, RopeScaling};
use serde_json::{Map, Value};

/// The object RoPE's parameters are read from, the key it was found under, and its type.
struct RopeObject<'a> {
    reader: &'a Reader<'a>,
    key: &'static str,
    obj: &'a Map<String, Value>,
    rope_type: String,
    /// The model's `max_position_embeddings`.
    max_positions: usize,
}

impl Reader<'_> {
    /// RoPE's theta and scaling.
    pub(super) fn rope(
        &self,
        max_positions: usize,
        default_theta: f64,
    ) -> Result<(f64, RopeScaling)> {
        let (key, found) = self.rope_source()?;
        let empty = Map::new();
        let obj = match found {
            None => &empty,
            Some(Value::Object(o)) => o,
            Some(other) => {
                return Err(self.field(key, format!("expected an object, found {other}")))
            }
        };
        if obj.values().any(Value::is_object) {
            return Err(self.field(
                key,
                "RoPE parameters per layer type are not implemented".into(),
            ));
        }
        let rope_type = match obj.get("rope_type").or_else(|| obj.get("type")) {
            None | Some(Value::Null) => "default".to_string(),
            Some(Value::String(s)) => s.clone(),
            Some(other) => {
                return Err(self.field(
                    &format!("{key}.rope_type"),
                    format!("expected a string, found {other}"),
                ))
            }
        };
        let r = RopeObject {
            reader: self,
            key,
            obj,
            rope_type,
            max_positions,
        };
        let theta = match r.num("rope_theta")?.or(self.opt_f64("rope_theta")?) {
            None => default_theta,
            Some(t) if t > 0.0 && t.is_finite() => t,
            Some(t) => return Err(self.field("rope_theta", format!("{t} must be positive"))),
        };
        r.check_keys()?;
        Ok((theta, r.scaling()?))
    }

    /// Where RoPE's parameters are: `rope_parameters` (transformers 5), or `rope_scaling`; both
    /// present and of different types is an error, not a guess.
    fn rope_source(&self) -> Result<(&'static str, Option<&Value>)> {
        let params = self.v.get("rope_parameters").filter(|v| !v.is_null());
        let scaling = self.v.get("rope_scaling").filter(|v| !v.is_null());
        Ok(match (params, scaling) {
            (Some(p), Some(s)) if p != s => {
                let p_type = p.get("rope_type").or_else(|| p.get("type"));
                let s_type = s.get("rope_type").or_else(|| s.get("type"));
                if p_type.is_some() && s_type.is_some() && p_type != s_type {
                    return Err(self.field(
                        "rope_scaling",
                        "disagrees with rope_parameters: give one of them".into(),
                    ));
                }
                ("rope_parameters", Some(p))
            }
            (Some(p), _) => ("rope_parameters", Some(p)),
            (None, Some(s)) => ("rope_scaling", Some(s)),
            (None, None) => ("rope_parameters", None),
        })
    }
}

impl RopeObject<'_> {
    fn at(&self, k: &str) -> String {
        format!("{}.{k}", self.key)
    }

    fn num(&self, k: &str) -> Result<Option<f64>> {
        match self.obj.get(k).filter(|v| !v.is_null()) {
            None => Ok(None),
            Some(v) => match v.as_f64() {
                Some(x) if x.is_finite() => Ok(Some(x)),
                _ => Err(self
                    .reader
                    .field(&self.at(k), format!("expected a finite number, found {v}"))),
            },
        }
    }

    fn required(&self, k: &str) -> Result<f64> {
        match self.num(k)? {
            Some(x) if x > 0.0 => Ok(x),
            Some(x) => Err(self
                .reader
                .field(&self.at(k), format!("{x} must be positive"))),
            None => Err(self.reader.field(
                &self.at(k),
                format!("missing (rope_type `{}`)", self.rope_type),
            )),
        }
    }

    fn original(&self) -> Result<f64> {
        Ok(self
            .num("original_max_position_embeddings")?
            .unwrap_or(self.max_positions as f64))
    }

    /// The type is implemented, every key is one of its parameters, and the rotation is full.
    fn check_keys(&self) -> Result<()> {
        let rope_type = &self.rope_type;
        let Some(keys) = rope_keys(rope_type) else {
            return Err(self.reader.field(
                &self.at("rope_type"),
                format!(
                    "`{rope_type}` is not implemented (ferrotron implements default, linear, \
                     dynamic, llama3 and yarn)"
                ),
            ));
        };
        for k in self.obj.keys() {
            let common = ["rope_type", "type", "rope_theta", "partial_rotary_factor"];
            if !common.contains(&k.as_str()) && !keys.contains(&k.as_str()) {
                return Err(self.reader.field(
                    &self.at(k),
                    format!("not a parameter of rope_type `{rope_type}` that ferrotron implements"),
                ));
            }
        }
        if let Some(f) = self.num("partial_rotary_factor")? {
            if f != 1.0 {
                return Err(self.reader.field(
                    &self.at("partial_rotary_factor"),
                    format!("{f} is not implemented (only 1.0)"),
                ));
            }
        }
        Ok(())
    }

    fn scaling(&self) -> Result<RopeScaling> {
        Ok(match self.rope_type.as_str() {
            "default" => RopeScaling::Default,
            "linear" => RopeScaling::Linear {
                factor: self.required("factor")?,
            },
            "dynamic" => RopeScaling::Dynamic {
                factor: self.required("factor")?,
            },
            "llama3" => self.llama3()?,
            "yarn" => self.yarn()?,
            _ => unreachable!("rope_keys knows only the types above"),
        })
    }

    fn llama3(&self) -> Result<RopeScaling> {
        let (low, high) = (
            self.required("low_freq_factor")?,
            self.required("high_freq_factor")?,
        );
        if low == high {
            return Err(self.reader.field(
                &self.at("high_freq_factor"),
                "equals low_freq_factor: the ramp between them has no width".into(),
            ));
        }
        Ok(RopeScaling::Llama3 {
            factor: self.required("factor")?,
            low_freq_factor: low,
            high_freq_factor: high,
            original_max_position_embeddings: self.original()?,
        })
    }

    fn yarn(&self) -> Result<RopeScaling> {
        let original = self.original()?;
        let factor = match self.num("factor")? {
            None => self.max_positions as f64 / original,
            Some(_) => self.required("factor")?,
        };
        let attention_factor = match self.num("attention_factor")? {
            Some(a) => a,
            None => match (self.num("mscale")?, self.num("mscale_all_dim")?) {
                (Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
                    yarn_mscale(factor, m) / yarn_mscale(factor, all)
                }
                _ => yarn_mscale(factor, 1.0),
            },
        };
        // transformers: `get("beta_fast") or 32`, so 0 also means the default.
        let or = |k: &str, d: f64| -> Result<f64> {
            Ok(self.num(k)?.filter(|&x| x != 0.0).unwrap_or(d))
        };
        let truncate = match self.obj.get("truncate") {
            None | Some(Value::Null) => true,
            Some(Value::Bool(b)) => *b,
            Some(other) => {
                return Err(self.reader.field(
                    &self.at("truncate"),
                    format!("expected true or false, found {other}"),
                ))
            }
        };
        Ok(RopeScaling::Yarn {
            factor,
            original_max_position_embeddings: original,
            attention_factor,
            beta_fast: or("beta_fast", 32.0)?,
            beta_slow: or("beta_slow", 1.0)?,
            truncate,
        })
    }
}
