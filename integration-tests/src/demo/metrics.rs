//! The demo apps' optional Prometheus endpoint: `--metrics-addr HOST:PORT`
//! (or `ONCEONLY_METRICS_ADDR`) serves onceonly's metrics (see
//! `onceonly::telemetry`) in the Prometheus text format on every path of
//! that address, e.g. `curl http://127.0.0.1:9464/metrics`.

use std::net::SocketAddr;

use metrics_exporter_prometheus::PrometheusBuilder;

/// The flag, flattened into each example's arguments.
#[derive(clap::Args, Debug)]
pub struct MetricsArgs {
    /// Serve Prometheus metrics on this address (HOST:PORT), e.g. 127.0.0.1:9464.
    #[arg(long, env = "ONCEONLY_METRICS_ADDR", value_name = "HOST:PORT")]
    pub metrics_addr: Option<SocketAddr>,
}

impl MetricsArgs {
    /// Installs the Prometheus recorder and its HTTP listener if an address
    /// was given. Call it before building consumers or layers: their metric
    /// handles are resolved when they are built.
    pub fn install(&self) -> Result<(), Box<dyn std::error::Error>> {
        let Some(addr) = self.metrics_addr else {
            return Ok(());
        };
        // Buckets, not summaries: histogram_quantile() over every process
        // (deploy/grafana/onceonly.json).
        PrometheusBuilder::new()
            .set_buckets(onceonly::telemetry::DURATION_BUCKETS)?
            .with_http_listener(addr)
            .install()?;
        onceonly::telemetry::describe_metrics();
        eprintln!("metrics on http://{addr}/metrics");
        Ok(())
    }
}
