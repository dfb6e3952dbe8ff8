//! GET a text-format `/metrics` page and parse it with our own parser.

use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use tokio::time::Instant;

use super::text::{self, Exposition};
use super::{MetricsEndpoint, Source, SourceError, Timestamped};

/// Largest page read; a bigger one is an error rather than a memory spike.
const MAX_PAGE_BYTES: usize = 32 * 1024 * 1024;

/// A [`Source`] that scrapes one `/metrics` URL.
#[derive(Debug, Clone)]
pub struct Scrape {
    fetcher: Fetcher,
    url: url::Url,
    timeout: Duration,
}

/// How the page is fetched.
#[derive(Debug, Clone)]
enum Fetcher {
    Http(reqwest::Client),
    InProcess(Arc<dyn MetricsEndpoint>),
}

impl Scrape {
    /// Scrapes `url` with `client`, each request bounded by `timeout`.
    pub fn new(client: reqwest::Client, url: url::Url, timeout: Duration) -> Self {
        Self {
            fetcher: Fetcher::Http(client),
            url,
            timeout,
        }
    }

    /// Reads `url` from an in-process endpoint (`sluicegate eval`).
    pub fn in_process(endpoint: Arc<dyn MetricsEndpoint>, url: url::Url) -> Self {
        Self {
            fetcher: Fetcher::InProcess(endpoint),
            url,
            timeout: Duration::ZERO,
        }
    }

    /// The scraped URL.
    pub fn url(&self) -> &url::Url {
        &self.url
    }

    /// The URL, password masked.
    pub fn describe_url(&self) -> String {
        crate::secret::mask_url(&self.url)
    }

    async fn read(&self) -> Result<Timestamped<Arc<Exposition>>, SourceError> {
        // The page describes the pool somewhere between send and receive;
        // the send time is the conservative choice for the window.
        let taken_at = Instant::now();
        let exposition = match &self.fetcher {
            Fetcher::Http(client) => self.read_http(client).await?,
            Fetcher::InProcess(endpoint) => parse_page(endpoint.page(&self.url)?.as_bytes())?,
        };
        Ok(Timestamped {
            value: Arc::new(exposition),
            taken_at,
        })
    }

    async fn read_http(&self, client: &reqwest::Client) -> Result<Exposition, SourceError> {
        let response = client
            .get(self.url.clone())
            .header(reqwest::header::ACCEPT, "text/plain;version=0.0.4")
            .timeout(self.timeout)
            .send()
            .await
            .map_err(|e| {
                if e.is_timeout() {
                    SourceError::Timeout(self.timeout)
                } else {
                    SourceError::transport(e)
                }
            })?;
        let status = response.status();
        if !status.is_success() {
            return Err(SourceError::Status(status.as_u16()));
        }
        let body = response.bytes().await.map_err(SourceError::transport)?;
        parse_page(&body)
    }
}

/// Checks a page's size and encoding and parses it.
fn parse_page(body: &[u8]) -> Result<Exposition, SourceError> {
    if body.len() > MAX_PAGE_BYTES {
        return Err(SourceError::Parse(format!(
            "page of {} bytes exceeds {MAX_PAGE_BYTES}",
            body.len()
        )));
    }
    let page = std::str::from_utf8(body).map_err(SourceError::NotUtf8)?;
    text::parse(page).map_err(SourceError::Exposition)
}

impl Source for Scrape {
    type Output = Arc<Exposition>;

    fn fetch(&self) -> BoxFuture<'_, Result<Timestamped<Arc<Exposition>>, SourceError>> {
        Box::pin(self.read())
    }

    fn describe(&self) -> String {
        crate::secret::mask_url(&self.url)
    }
}
