//! What a cluster is: nodes of devices, their memory and speed, and the two classes of link between them.
//! The planner prices layouts on it; the simulated interconnect of the threads backend charges by it.

/// One class of link (inside a node, or between nodes).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Link {
    /// Bytes per second per device per direction.
    pub bandwidth_bytes_per_s: f64,
    pub latency_s: f64,
}

#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Cluster {
    pub name: String,
    pub nodes: usize,
    pub devices_per_node: usize,
    pub device_memory_bytes: u64,
    pub peak_flops: f64,
    pub intra_node: Link,
    pub inter_node: Link,
}

impl Cluster {
    pub fn world_size(&self) -> usize {
        self.nodes * self.devices_per_node
    }
    /// Rank r sits on node r / devices_per_node (the design's placement rule).
    pub fn node_of(&self, rank: usize) -> usize {
        rank / self.devices_per_node
    }
}
