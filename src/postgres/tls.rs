//! TLS to PostgreSQL on the tree's rustls: `[sql] sslmode` with libpq's
//! names and meanings, and `[sql] tls_ca`.
//!
//! | `sslmode` | encrypted | certificate chain checked | host name checked |
//! |---|---|---|---|
//! | `disable` | no | — | — |
//! | `require` | yes | only when a CA is given (as libpq) | no |
//! | `verify-ca` | yes | yes | no |
//! | `verify-full` | yes | yes | yes |
//!
//! The chain is checked against `tls_ca` (a PEM file), else the system's
//! roots. tokio-postgres takes any [`MakeTlsConnect`]; [`MakeRustls`] is
//! the small adapter from tokio-rustls to it (no channel binding: SCRAM
//! falls back to plain SCRAM, as over any TLS library without it).

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures_util::future::BoxFuture;
use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
};
use serde::Serialize;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect, TlsStream};

/// `[sql] sslmode`: libpq's names for how much TLS the connection needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum SslMode {
    /// Plain TCP (the default, as before TLS was supported).
    #[serde(rename = "disable")]
    Disable,
    /// Encrypted; the certificate is checked only when a CA is given.
    #[serde(rename = "require")]
    Require,
    /// Encrypted, the certificate chain checked, not the host name.
    #[serde(rename = "verify-ca")]
    VerifyCa,
    /// Encrypted, the chain and the host name checked.
    #[serde(rename = "verify-full")]
    VerifyFull,
}

impl SslMode {
    /// Every accepted spelling.
    pub const CHOICES: &'static [(&'static str, SslMode)] = &[
        ("disable", SslMode::Disable),
        ("require", SslMode::Require),
        ("verify-ca", SslMode::VerifyCa),
        ("verify-full", SslMode::VerifyFull),
    ];

    /// The config spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Disable => "disable",
            Self::Require => "require",
            Self::VerifyCa => "verify-ca",
            Self::VerifyFull => "verify-full",
        }
    }

    /// The mode spelled `text`, if it is one.
    pub fn parse(text: &str) -> Option<Self> {
        Self::CHOICES
            .iter()
            .find(|(name, _)| *name == text)
            .map(|(_, mode)| *mode)
    }
}

/// What TLS the database connection uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SqlTls {
    /// How much TLS.
    pub mode: SslMode,
    /// The CA certificates (PEM) the server's chain must lead to; the
    /// system's roots when `None`.
    pub ca: Option<PathBuf>,
}

impl SqlTls {
    /// No TLS.
    pub const PLAIN: SqlTls = SqlTls {
        mode: SslMode::Disable,
        ca: None,
    };

    /// `sql.sslmode = … (sql.tls_ca = …)`, for messages.
    pub fn describe(&self) -> String {
        match &self.ca {
            Some(ca) => format!(
                "sql.sslmode = {}, sql.tls_ca = {}",
                self.mode.as_str(),
                ca.display()
            ),
            None => format!("sql.sslmode = {}", self.mode.as_str()),
        }
    }
}

/// The URL query parameters libpq reads for TLS, moved out of a URL:
/// tokio-postgres knows neither `verify-ca` / `verify-full` nor
/// `sslrootcert`, and upstream's URLs may carry them.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct UrlTls {
    /// `sslmode=…`, as written.
    pub(super) sslmode: Option<String>,
    /// `sslrootcert=…`.
    pub(super) sslrootcert: Option<PathBuf>,
}

/// Splits `sslmode` and `sslrootcert` off `url`'s query; the rest of the
/// URL is what tokio-postgres parses.
pub(super) fn split_url_tls(url: &url::Url) -> (url::Url, UrlTls) {
    let mut found = UrlTls::default();
    let kept: Vec<(String, String)> = url
        .query_pairs()
        .filter_map(|(k, v)| match k.as_ref() {
            "sslmode" => {
                found.sslmode = Some(v.into_owned());
                None
            }
            "sslrootcert" => {
                found.sslrootcert = Some(PathBuf::from(v.as_ref()));
                None
            }
            _ => Some((k.into_owned(), v.into_owned())),
        })
        .collect();
    let mut rest = url.clone();
    if kept.is_empty() {
        rest.set_query(None);
    } else {
        rest.query_pairs_mut().clear().extend_pairs(kept);
    }
    (rest, found)
}

/// The TLS settings from the config's keys and the URL's parameters: a
/// key wins when only it is set, the URL's parameter when only it is;
/// both set and different is an error. `Err` is a message for the key
/// (`sslmode` or `tls_ca`).
pub(super) fn resolve(
    sslmode: Option<SslMode>,
    tls_ca: Option<&Path>,
    url: &UrlTls,
) -> Result<SqlTls, (&'static str, String)> {
    let from_url = match url.sslmode.as_deref() {
        None => None,
        Some(text) => Some(SslMode::parse(text).ok_or_else(|| {
            (
                "sslmode",
                format!(
                    "the URL's sslmode={text} is not supported; allowed: disable, require, verify-ca, verify-full"
                ),
            )
        })?),
    };
    let mode = match (sslmode, from_url) {
        (Some(key), Some(param)) if key != param => {
            return Err((
                "sslmode",
                format!(
                    "{} contradicts the URL's sslmode={}; give it once",
                    key.as_str(),
                    param.as_str()
                ),
            ));
        }
        (key, param) => key.or(param).unwrap_or(SslMode::Disable),
    };
    let ca = match (tls_ca, url.sslrootcert.as_deref()) {
        (Some(key), Some(param)) if key != param => {
            return Err((
                "tls_ca",
                format!(
                    "{} contradicts the URL's sslrootcert={}; give it once",
                    key.display(),
                    param.display()
                ),
            ));
        }
        (key, param) => key.or(param).map(Path::to_path_buf),
    };
    if mode == SslMode::Disable && ca.is_some() {
        return Err((
            "tls_ca",
            "a CA is only used with TLS; set sslmode to require, verify-ca or verify-full"
                .to_owned(),
        ));
    }
    Ok(SqlTls { mode, ca })
}

/// Why the TLS client could not be set up (read at start-up).
#[derive(Debug, thiserror::Error)]
pub enum TlsSetupError {
    /// The CA file cannot be read or holds no certificate.
    #[error("sql.tls_ca: {path}: {message}")]
    Ca {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// No system roots to check against.
    #[error(
        "sql.tls_ca: required with sql.sslmode = {mode}: no system CA certificates found ({message})"
    )]
    NoRoots {
        /// The mode that needs them.
        mode: &'static str,
        /// Why none were loaded.
        message: String,
    },
    /// rustls refused the configuration.
    #[error("sql.sslmode: {0}")]
    Rustls(#[from] rustls::Error),
}

/// The trust anchors: the CA file's certificates, else the system's.
fn roots(tls: &SqlTls) -> Result<RootCertStore, TlsSetupError> {
    let mut store = RootCertStore::empty();
    match &tls.ca {
        Some(path) => {
            let ca_error = |message: String| TlsSetupError::Ca {
                path: path.clone(),
                message,
            };
            let bytes = std::fs::read(path).map_err(|e| ca_error(e.to_string()))?;
            let certs = CertificateDer::pem_slice_iter(&bytes)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| ca_error(format!("not PEM certificates: {e}")))?;
            if certs.is_empty() {
                return Err(ca_error("no certificate in it".to_owned()));
            }
            for cert in certs {
                store
                    .add(cert)
                    .map_err(|e| ca_error(format!("not a usable CA certificate: {e}")))?;
            }
        }
        None => {
            let found = rustls_native_certs::load_native_certs();
            let (added, _) = store.add_parsable_certificates(found.certs);
            if added == 0 {
                let message = (found.errors.first())
                    .map_or_else(|| "none installed".to_owned(), ToString::to_string);
                return Err(TlsSetupError::NoRoots {
                    mode: tls.mode.as_str(),
                    message,
                });
            }
        }
    }
    Ok(store)
}

/// The connector for `tls`; `None` for `disable`.
pub(super) fn connector(tls: &SqlTls) -> Result<Option<MakeRustls>, TlsSetupError> {
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let verifier: Arc<dyn ServerCertVerifier> = match (tls.mode, &tls.ca) {
        (SslMode::Disable, _) => return Ok(None),
        // libpq: `require` checks nothing, unless a root certificate is
        // given; then it is `verify-ca`.
        (SslMode::Require, None) => Arc::new(Unchecked(provider.clone())),
        (SslMode::Require | SslMode::VerifyCa, _) => Arc::new(ChainOnly(
            WebPkiServerVerifier::builder_with_provider(Arc::new(roots(tls)?), provider.clone())
                .build()
                .map_err(|e| rustls::Error::General(e.to_string()))?,
        )),
        (SslMode::VerifyFull, _) => {
            WebPkiServerVerifier::builder_with_provider(Arc::new(roots(tls)?), provider.clone())
                .build()
                .map_err(|e| rustls::Error::General(e.to_string()))?
        }
    };
    let config = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_no_client_auth();
    Ok(Some(MakeRustls(tokio_rustls::TlsConnector::from(
        Arc::new(config),
    ))))
}

/// The TLS failure in `error` (or what it wraps): the handshake or the
/// certificate, as opposed to the server refusing us; `None` when it is
/// not one.
pub(super) fn tls_failure(error: &(dyn std::error::Error + 'static)) -> Option<String> {
    let mut next = Some(error);
    while let Some(e) = next {
        if let Some(tls) = e.downcast_ref::<rustls::Error>() {
            return Some(tls.to_string());
        }
        if let Some(inner) = (e.downcast_ref::<io::Error>())
            .and_then(io::Error::get_ref)
            .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        {
            return Some(inner.to_string());
        }
        next = e.source();
    }
    None
}

/// Checks the chain only: a certificate for another name is accepted
/// (`verify-ca`).
#[derive(Debug)]
struct ChainOnly(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        // webpki checks the chain first, the name last: a name error means
        // the chain was good.
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// Checks no certificate (`require` without a CA, as libpq): the session
/// is encrypted, the server unauthenticated. The handshake's signatures
/// are still verified, so the key exchange is sound.
#[derive(Debug)]
struct Unchecked(Arc<CryptoProvider>);

impl ServerCertVerifier for Unchecked {
    fn verify_server_cert(
        &self,
        _: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: &ServerName<'_>,
        _: &[u8],
        _: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// tokio-postgres's TLS hook over tokio-rustls.
#[derive(Clone)]
pub(super) struct MakeRustls(tokio_rustls::TlsConnector);

impl fmt::Debug for MakeRustls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("MakeRustls")
    }
}

impl<S> MakeTlsConnect<S> for MakeRustls
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = RustlsStream<S>;
    type TlsConnect = RustlsConnect;
    type Error = rustls::pki_types::InvalidDnsNameError;

    fn make_tls_connect(&mut self, domain: &str) -> Result<RustlsConnect, Self::Error> {
        // An IP address is a name too (checked against the certificate's
        // IP SANs under `verify-full`).
        let name = ServerName::try_from(domain.to_owned())?;
        Ok(RustlsConnect {
            connector: self.0.clone(),
            name,
        })
    }
}

/// One connection's handshake.
pub(super) struct RustlsConnect {
    connector: tokio_rustls::TlsConnector,
    name: ServerName<'static>,
}

impl<S> TlsConnect<S> for RustlsConnect
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = RustlsStream<S>;
    type Error = io::Error;
    type Future = BoxFuture<'static, io::Result<RustlsStream<S>>>;

    fn connect(self, stream: S) -> Self::Future {
        Box::pin(async move {
            let tls = self.connector.connect(self.name, stream).await?;
            Ok(RustlsStream(tls))
        })
    }
}

/// A TLS session to the server.
pub(super) struct RustlsStream<S>(tokio_rustls::client::TlsStream<S>);

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for RustlsStream<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for RustlsStream<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> TlsStream for RustlsStream<S> {
    fn channel_binding(&self) -> ChannelBinding {
        ChannelBinding::none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn url_tls(mode: Option<&str>, root: Option<&str>) -> UrlTls {
        UrlTls {
            sslmode: mode.map(str::to_owned),
            sslrootcert: root.map(PathBuf::from),
        }
    }

    #[test]
    fn a_key_or_the_urls_parameter_sets_the_mode_and_both_must_agree() {
        let none = UrlTls::default();
        assert_eq!(resolve(None, None, &none), Ok(SqlTls::PLAIN));
        let from_url = resolve(None, None, &url_tls(Some("verify-full"), Some("/ca.pem")));
        assert_eq!(
            from_url,
            Ok(SqlTls {
                mode: SslMode::VerifyFull,
                ca: Some(PathBuf::from("/ca.pem"))
            })
        );
        let same = resolve(
            Some(SslMode::Require),
            None,
            &url_tls(Some("require"), None),
        );
        assert_eq!(same.map(|t| t.mode), Ok(SslMode::Require));
        let clash = resolve(
            Some(SslMode::VerifyFull),
            None,
            &url_tls(Some("disable"), None),
        );
        assert_eq!(clash.map_err(|e| e.0), Err("sslmode"));
        let unknown = resolve(None, None, &url_tls(Some("prefer"), None));
        let (key, message) = unknown.expect_err("prefer is not offered");
        assert_eq!(key, "sslmode");
        assert!(message.contains("allowed: disable, require, verify-ca, verify-full"));
        let ca_without_tls = resolve(None, Some(Path::new("/ca.pem")), &none);
        assert_eq!(ca_without_tls.map_err(|e| e.0), Err("tls_ca"));
    }

    #[test]
    fn tls_parameters_leave_the_url_and_the_rest_stays() {
        let url = url::Url::parse(
            "postgres://u@db:5432/app?sslmode=verify-full&application_name=x&sslrootcert=%2Fca.pem",
        )
        .expect("url");
        let (rest, tls) = split_url_tls(&url);
        assert_eq!(rest.as_str(), "postgres://u@db:5432/app?application_name=x");
        assert_eq!(tls, url_tls(Some("verify-full"), Some("/ca.pem")));
        let plain = url::Url::parse("postgres://u@db/app?sslmode=require").expect("url");
        assert_eq!(split_url_tls(&plain).0.as_str(), "postgres://u@db/app");
    }
}
