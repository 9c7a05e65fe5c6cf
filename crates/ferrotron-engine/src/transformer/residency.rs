//! Where a device's parameters and gradients are while the executor runs. By default every tensor is
//! present for the whole pass ([`Resident`]); a sharded runtime (ZeRO-3) gathers a unit's parameters
//! just before the executor uses them and frees them after, and (ZeRO-2/3) reduces a unit's gradients
//! away as soon as its backward is done. The executor brackets each unit's work with these calls and
//! knows nothing else of it.

use super::{FrozenBase, ParamStore};
use ferrotron_core::model::ModelConfig;

/// The groups of parameters the executor uses together.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Unit {
    /// The token (and position) embedding, on the first stage.
    Embedding,
    /// Transformer block `i` (its index in the whole model).
    Layer(usize),
    /// The final norm and the output layer (the tied embedding when tied), on the last stage.
    Head,
}

/// The unit(s) parameter `name` belongs to: its block, the embedding, the head (the tied embedding is
/// in both the embedding and the head).
pub fn units_of(cfg: &ModelConfig, name: &str) -> Vec<Unit> {
    let (fw, fb) = cfg.final_norm_names();
    let mut units = Vec::new();
    if name == cfg.embedding_name() || Some(name) == cfg.position_embedding_name() {
        units.push(Unit::Embedding);
    }
    if name == fw || Some(name) == fb || name == cfg.lm_head_name() {
        units.push(Unit::Head);
    }
    if units.is_empty() {
        let rest = name
            .strip_prefix("model.layers.")
            .or_else(|| name.strip_prefix("transformer.h."));
        if let Some(i) = rest.and_then(|r| r.split('.').next()?.parse().ok()) {
            units.push(Unit::Layer(i));
        }
    }
    units
}

pub trait Residency {
    /// The units a pass (one chunk's forward, or its backward) will ask for, in order, each once.
    /// A sharded residency may start fetching a unit before it is asked for.
    fn begin_pass(&mut self, _units: &[Unit]) {}
    /// Runs `f` with `unit`'s parameters present in the store it is given.
    fn params(&mut self, unit: Unit, f: &mut dyn FnMut(&ParamStore));
    /// Runs `f` with `unit`'s parameters present and a gradient store its weight gradients accumulate
    /// into.
    fn params_and_grads(&mut self, unit: Unit, f: &mut dyn FnMut(&ParamStore, &mut ParamStore));
    /// A frozen base's `unit` whose codes are sharded ([`FrozenBase::needs_gather`]), gathered; a
    /// residency that shards nothing never sees one.
    fn gather_frozen(&mut self, unit: Unit, _base: &FrozenBase) -> ParamStore {
        panic!("{unit:?}: a frozen base sharded over replicas needs a sharding residency (ZeRO-3)")
    }
}

/// Every parameter present throughout; gradients (if any) accumulate in one store.
pub struct Resident<'a> {
    params: &'a ParamStore,
    grads: Option<&'a mut ParamStore>,
}

impl<'a> Resident<'a> {
    /// Parameters only (a forward pass, or a backward whose weight gradients are deferred).
    pub fn new(params: &'a ParamStore) -> Self {
        Self {
            params,
            grads: None,
        }
    }
    pub fn with_grads(params: &'a ParamStore, grads: &'a mut ParamStore) -> Self {
        Self {
            params,
            grads: Some(grads),
        }
    }
}

impl Residency for Resident<'_> {
    fn params(&mut self, _unit: Unit, f: &mut dyn FnMut(&ParamStore)) {
        f(self.params)
    }
    fn params_and_grads(&mut self, _unit: Unit, f: &mut dyn FnMut(&ParamStore, &mut ParamStore)) {
        let g = self
            .grads
            .as_deref_mut()
            .expect("a backward that accumulates weight gradients needs a gradient store");
        f(self.params, g)
    }
}
