//! Values that a settings file and a flag write as text: serialised as their `Display`, read back
//! through their `FromStr` (whose error names what is accepted), so a bad one is refused where the
//! file or the flag is read.

/// Implements `serde::Serialize` and `serde::Deserialize` for a type through its `Display` and
/// `FromStr`.
#[macro_export]
macro_rules! serde_as_text {
    ($t:ty) => {
        impl serde::Serialize for $t {
            fn serialize<S: serde::Serializer>(
                &self,
                s: S,
            ) -> std::result::Result<S::Ok, S::Error> {
                s.collect_str(self)
            }
        }

        impl<'de> serde::Deserialize<'de> for $t {
            fn deserialize<D: serde::Deserializer<'de>>(
                d: D,
            ) -> std::result::Result<Self, D::Error> {
                let s = String::deserialize(d)?;
                s.parse().map_err(serde::de::Error::custom)
            }
        }
    };
}
