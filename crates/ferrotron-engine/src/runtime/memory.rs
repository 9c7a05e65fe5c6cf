/// Bytes per device by term, as the design names them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MemoryTerms {
    pub weights: u64,
    pub gradients: u64,
    pub master_weights: u64,
    pub optimizer_states: u64,
    pub activations: u64,
    pub comm_buffers: u64,
    pub total: u64,
}

impl MemoryTerms {
    pub fn with_total(mut self) -> Self {
        self.total = self.weights
            + self.gradients
            + self.master_weights
            + self.optimizer_states
            + self.activations
            + self.comm_buffers;
        self
    }
}
