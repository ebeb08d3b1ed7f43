//! The TLS mode's credentials, made fresh at every start like a small kubeadm: a cluster CA,
//! a serving certificate it signs, and a random ServiceAccount-style bearer token.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result, anyhow};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::ServerConfig;
use tokio_rustls::rustls::crypto::ring;
use tokio_rustls::rustls::pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer};

/// DNS names a real API server's certificate covers (in-cluster clients use them).
const DNS_SANS: &[&str] = &[
    "localhost",
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
];

/// A CA and a server certificate for `ips` (plus loopback and [`DNS_SANS`]).
pub(crate) struct Pki {
    pub ca_pem: String,
    pub acceptor: TlsAcceptor,
}

impl Pki {
    pub fn new(ips: &[IpAddr]) -> Result<Pki> {
        let mut ca = CertificateParams::default();
        ca.distinguished_name.push(DnType::CommonName, "kubernetes");
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
        ];
        let ca_key = KeyPair::generate().context("CA key")?;
        let ca_pem = ca.self_signed(&ca_key).context("CA certificate")?.pem();
        let issuer = Issuer::new(ca, ca_key);

        let mut server = CertificateParams::default();
        server
            .distinguished_name
            .push(DnType::CommonName, "kube-apiserver");
        server.use_authority_key_identifier_extension = true;
        server.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        server.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let mut all_ips: Vec<IpAddr> = vec![Ipv4Addr::LOCALHOST.into(), Ipv6Addr::LOCALHOST.into()];
        for ip in ips {
            if !ip.is_unspecified() && !all_ips.contains(ip) {
                all_ips.push(*ip);
            }
        }
        server.subject_alt_names = all_ips.into_iter().map(SanType::IpAddress).collect();
        for name in DNS_SANS {
            let name = (*name).try_into().context("DNS SAN")?;
            server.subject_alt_names.push(SanType::DnsName(name));
        }
        let key = KeyPair::generate().context("server key")?;
        let cert = server
            .signed_by(&key, &issuer)
            .context("server certificate")?;

        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        let mut config = ServerConfig::builder_with_provider(Arc::new(ring::default_provider()))
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_single_cert(vec![cert.der().clone()], key)?;
        // HTTP/1.1 only, like the rest of this server (kube-rs asks for nothing else).
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Pki {
            ca_pem,
            acceptor: TlsAcceptor::from(Arc::new(config)),
        })
    }
}

/// An opaque random bearer token (a real one is a signed JWT; nobody here parses it).
pub(crate) fn random_token() -> Result<String> {
    let mut bytes = [0u8; 24];
    ring::default_provider()
        .secure_random
        .fill(&mut bytes)
        .map_err(|e| anyhow!("random token: {e:?}"))?;
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    Ok(format!("nftpt-{hex}"))
}

/// A kubeconfig like the one in kubeadm's `kube-proxy` ConfigMap: the CA and the token are
/// read from files (so they can be the mounted ServiceAccount's).
pub fn kubeadm_kubeconfig(server: &str, ca_file: &Path, token_file: &Path) -> String {
    format!(
        "apiVersion: v1
kind: Config
clusters:
- name: default
  cluster:
    server: {server}
    certificate-authority: {}
users:
- name: default
  user:
    tokenFile: {}
contexts:
- name: default
  context:
    cluster: default
    user: default
    namespace: default
current-context: default
",
        ca_file.display(),
        token_file.display()
    )
}
