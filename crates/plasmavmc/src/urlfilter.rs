//! Which import URLs are allowed: http(s) only, and (unless the config allows
//! it) no loopback, private, link-local, multicast or otherwise special
//! targets. Pure functions; the importer resolves the host once, checks every
//! address here, and connects to exactly the checked address so a DNS answer
//! cannot change between check and use.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// Why a URL or an address is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UrlError {
    #[error("not a valid URL: {0}")]
    Parse(String),
    #[error("scheme {0:?} is not allowed (only http and https)")]
    Scheme(String),
    #[error("the URL has no host")]
    NoHost,
    #[error("URLs with user names or passwords are not allowed")]
    Credentials,
    #[error("address {0} is {1} and private targets are not allowed")]
    Private(IpAddr, &'static str),
}

/// Parses and checks the parts of a URL that need no DNS.
pub fn check_url(raw: &str) -> Result<url::Url, UrlError> {
    let u = url::Url::parse(raw).map_err(|e| UrlError::Parse(e.to_string()))?;
    if u.scheme() != "http" && u.scheme() != "https" {
        return Err(UrlError::Scheme(u.scheme().to_owned()));
    }
    if !u.username().is_empty() || u.password().is_some() {
        return Err(UrlError::Credentials);
    }
    if u.host().is_none() {
        return Err(UrlError::NoHost);
    }
    Ok(u)
}

fn v4_class(ip: Ipv4Addr) -> Option<&'static str> {
    let o = ip.octets();
    if ip.is_loopback() {
        Some("loopback")
    } else if ip.is_private() {
        Some("private")
    } else if ip.is_link_local() {
        Some("link-local")
    } else if ip.is_unspecified() || o[0] == 0 {
        Some("unspecified")
    } else if ip.is_broadcast() || ip.is_multicast() || o[0] >= 240 {
        Some("broadcast, multicast or reserved")
    } else if o[0] == 100 && (o[1] & 0xc0) == 64 {
        Some("carrier-grade NAT")
    } else if o[0] == 198 && (o[1] & 0xfe) == 18 {
        Some("benchmarking")
    } else {
        None
    }
}

/// The class that makes an address off limits, if any.
pub fn private_class(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => v4_class(v4),
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return v4_class(v4);
            }
            let s = v6.segments();
            if v6.is_loopback() {
                Some("loopback")
            } else if v6.is_unspecified() {
                Some("unspecified")
            } else if (s[0] & 0xfe00) == 0xfc00 {
                Some("unique-local (private)")
            } else if (s[0] & 0xffc0) == 0xfe80 {
                Some("link-local")
            } else if v6.is_multicast() {
                Some("multicast")
            } else if s[0] == 0x64 && s[1] == 0xff9b || v6 == Ipv6Addr::new(0, 0, 0, 0, 0, 0xffff, 0, 0) {
                Some("translated")
            } else {
                None
            }
        }
    }
}

/// Checks one resolved address.
pub fn check_ip(ip: IpAddr, allow_private: bool) -> Result<(), UrlError> {
    match private_class(ip) {
        Some(class) if !allow_private => Err(UrlError::Private(ip, class)),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn special_targets_are_refused_and_public_ones_allowed() {
        for bad in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "0.0.0.0",
            "::1",
            "fe80::1",
            "fd00::1",
            "::ffff:127.0.0.1",
            "100.64.0.1",
            "224.0.0.1",
        ] {
            let ip: IpAddr = bad.parse().expect("ip");
            assert!(check_ip(ip, false).is_err(), "{bad} should be refused");
            assert!(check_ip(ip, true).is_ok(), "{bad} allowed when configured");
        }
        for good in ["93.184.216.34", "2606:4700::1111", "8.8.8.8"] {
            assert!(check_ip(good.parse().expect("ip"), false).is_ok(), "{good}");
        }
    }

    #[test]
    fn only_plain_http_urls_pass() {
        assert!(check_url("https://example.com/a.qcow2").is_ok());
        assert_eq!(check_url("file:///etc/passwd").unwrap_err(), UrlError::Scheme("file".into()));
        assert_eq!(check_url("ftp://x/y").unwrap_err(), UrlError::Scheme("ftp".into()));
        assert_eq!(check_url("http://u:p@example.com/").unwrap_err(), UrlError::Credentials);
        assert!(matches!(check_url("not a url"), Err(UrlError::Parse(_))));
    }

    proptest! {
        #[test]
        fn every_ipv4_in_10_slash_8_is_refused(b in any::<[u8; 3]>()) {
            let ip = IpAddr::V4(Ipv4Addr::new(10, b[0], b[1], b[2]));
            prop_assert!(check_ip(ip, false).is_err());
        }

        #[test]
        fn arbitrary_strings_never_panic(s in ".{0,64}") {
            let _ = check_url(&s);
        }
    }
}
