//! Fixed newstyle negotiation: message encoding and decoding for both sides,
//! and [`Negotiator`], the server's option state machine.
//!
//! The negotiator is pure: it is fed one option (code and payload) at a time
//! and appends the bytes to send back to an output buffer, telling the caller
//! whether to keep negotiating, start TLS, enter transmission or close. TLS
//! follows the spec's modes: [`TlsMode::Off`] is NOTLS, [`TlsMode::Require`]
//! is FORCEDTLS and [`TlsMode::Allow`] is SELECTIVETLS with no TLS-only
//! export (nbdkit's `--tls=off|require|on`).

use super::reply::ReplyMode;
use super::*;

/// Size of the server greeting (`NBDMAGIC`, `IHAVEOPT`, handshake flags).
pub const GREETING_LEN: usize = 18;
/// Size of an option header from the client.
pub const OPTION_HEADER_LEN: usize = 16;
/// Size of an option reply header from the server.
pub const OPTION_REPLY_HEADER_LEN: usize = 20;

/// Appends the server greeting to `out`.
pub fn encode_greeting(out: &mut Vec<u8>) {
    out.extend_from_slice(&NBD_MAGIC.to_be_bytes());
    out.extend_from_slice(&IHAVEOPT.to_be_bytes());
    out.extend_from_slice(&(handshake_flags::FIXED_NEWSTYLE | handshake_flags::NO_ZEROES).to_be_bytes());
}

/// Checks the greeting a server sent, returning its handshake flags.
pub fn decode_greeting(b: &[u8; GREETING_LEN]) -> Result<u16, ProtoError> {
    let m = be_u64(b, 0);
    if m != NBD_MAGIC {
        return Err(ProtoError::BadMagic { expected: NBD_MAGIC, found: m });
    }
    let m = be_u64(b, 8);
    if m != IHAVEOPT {
        return Err(ProtoError::BadMagic { expected: IHAVEOPT, found: m });
    }
    Ok(be_u16(b, 16))
}

/// Validates the client's flags; unknown bits must end the session.
pub fn decode_client_flags(b: &[u8; 4]) -> Result<u32, ProtoError> {
    let flags = be_u32(b, 0);
    if flags & !(client_flags::FIXED_NEWSTYLE | client_flags::NO_ZEROES) != 0 {
        return Err(ProtoError::Unexpected(format!("unknown client flags {flags:#x}")));
    }
    Ok(flags)
}

/// Decodes an option header into (option code, payload length).
pub fn decode_option_header(b: &[u8; OPTION_HEADER_LEN]) -> Result<(u32, u32), ProtoError> {
    let m = be_u64(b, 0);
    if m != IHAVEOPT {
        return Err(ProtoError::BadMagic { expected: IHAVEOPT, found: m });
    }
    Ok((be_u32(b, 8), be_u32(b, 12)))
}

/// Appends an option (header and payload) as a client sends it.
pub fn encode_option(code: u32, data: &[u8], out: &mut Vec<u8>) {
    out.extend_from_slice(&IHAVEOPT.to_be_bytes());
    out.extend_from_slice(&code.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
}

/// Appends an option reply header and payload.
pub fn encode_option_reply(code: u32, reply: u32, data: &[u8], out: &mut Vec<u8>) {
    out.extend_from_slice(&OPT_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&code.to_be_bytes());
    out.extend_from_slice(&reply.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
}

/// Decodes an option reply header into (option code, reply type, length).
pub fn decode_option_reply_header(b: &[u8; OPTION_REPLY_HEADER_LEN]) -> Result<(u32, u32, u32), ProtoError> {
    let m = be_u64(b, 0);
    if m != OPT_REPLY_MAGIC {
        return Err(ProtoError::BadMagic { expected: OPT_REPLY_MAGIC, found: m });
    }
    Ok((be_u32(b, 8), be_u32(b, 12), be_u32(b, 16)))
}

/// A parsed client option.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientOption {
    ExportName(String),
    Abort,
    List,
    StartTls,
    Info { name: String, requests: Vec<u16> },
    Go { name: String, requests: Vec<u16> },
    StructuredReply,
    ListMetaContext { name: String, queries: Vec<String> },
    SetMetaContext { name: String, queries: Vec<String> },
    ExtendedHeaders,
    Unknown(u32),
}

impl ClientOption {
    /// Parses an option payload. An error here is answered with `ERR_INVALID`
    /// and negotiation goes on.
    pub fn parse(code: u32, data: &[u8]) -> Result<Self, ProtoError> {
        let empty = |o: ClientOption| {
            if data.is_empty() { Ok(o) } else { Err(ProtoError::BadLength("option takes no payload")) }
        };
        match code {
            opt::EXPORT_NAME => {
                if data.len() > MAX_STRING {
                    return Err(ProtoError::BadLength("export name longer than 4096 bytes"));
                }
                let s = std::str::from_utf8(data).map_err(|_| ProtoError::BadString("not UTF-8"))?;
                Ok(ClientOption::ExportName(s.to_owned()))
            }
            opt::ABORT => Ok(ClientOption::Abort),
            opt::LIST => empty(ClientOption::List),
            opt::STARTTLS => empty(ClientOption::StartTls),
            opt::STRUCTURED_REPLY => empty(ClientOption::StructuredReply),
            opt::EXTENDED_HEADERS => empty(ClientOption::ExtendedHeaders),
            opt::INFO | opt::GO => {
                let mut pos = 0;
                let name = take_string(data, &mut pos)?;
                if data.len() < pos + 2 {
                    return Err(ProtoError::Truncated { need: pos + 2, have: data.len() });
                }
                let n = be_u16(data, pos) as usize;
                pos += 2;
                if data.len() != pos + 2 * n {
                    return Err(ProtoError::BadLength("information request count does not match length"));
                }
                let requests = (0..n).map(|i| be_u16(data, pos + 2 * i)).collect();
                if code == opt::GO {
                    Ok(ClientOption::Go { name, requests })
                } else {
                    Ok(ClientOption::Info { name, requests })
                }
            }
            opt::LIST_META_CONTEXT | opt::SET_META_CONTEXT => {
                let mut pos = 0;
                let name = take_string(data, &mut pos)?;
                if data.len() < pos + 4 {
                    return Err(ProtoError::Truncated { need: pos + 4, have: data.len() });
                }
                let n = be_u32(data, pos) as usize;
                pos += 4;
                // Each query takes at least four bytes, which bounds `n` by the payload.
                if n > (data.len() - pos) / 4 {
                    return Err(ProtoError::BadLength("more queries than the payload can hold"));
                }
                let mut queries = Vec::with_capacity(n);
                for _ in 0..n {
                    queries.push(take_string(data, &mut pos)?);
                }
                if pos != data.len() {
                    return Err(ProtoError::BadLength("trailing bytes after queries"));
                }
                if code == opt::LIST_META_CONTEXT {
                    Ok(ClientOption::ListMetaContext { name, queries })
                } else {
                    Ok(ClientOption::SetMetaContext { name, queries })
                }
            }
            other => Ok(ClientOption::Unknown(other)),
        }
    }

    /// Encodes the payload of an option as a client sends it.
    pub fn encode_payload(&self) -> (u32, Vec<u8>) {
        fn name_and_requests(name: &str, requests: &[u16]) -> Vec<u8> {
            let mut v = Vec::new();
            v.extend_from_slice(&(name.len() as u32).to_be_bytes());
            v.extend_from_slice(name.as_bytes());
            v.extend_from_slice(&(requests.len() as u16).to_be_bytes());
            for r in requests {
                v.extend_from_slice(&r.to_be_bytes());
            }
            v
        }
        fn name_and_queries(name: &str, queries: &[String]) -> Vec<u8> {
            let mut v = Vec::new();
            v.extend_from_slice(&(name.len() as u32).to_be_bytes());
            v.extend_from_slice(name.as_bytes());
            v.extend_from_slice(&(queries.len() as u32).to_be_bytes());
            for q in queries {
                v.extend_from_slice(&(q.len() as u32).to_be_bytes());
                v.extend_from_slice(q.as_bytes());
            }
            v
        }
        match self {
            ClientOption::ExportName(n) => (opt::EXPORT_NAME, n.as_bytes().to_vec()),
            ClientOption::Abort => (opt::ABORT, vec![]),
            ClientOption::List => (opt::LIST, vec![]),
            ClientOption::StartTls => (opt::STARTTLS, vec![]),
            ClientOption::StructuredReply => (opt::STRUCTURED_REPLY, vec![]),
            ClientOption::ExtendedHeaders => (opt::EXTENDED_HEADERS, vec![]),
            ClientOption::Info { name, requests } => (opt::INFO, name_and_requests(name, requests)),
            ClientOption::Go { name, requests } => (opt::GO, name_and_requests(name, requests)),
            ClientOption::ListMetaContext { name, queries } => {
                (opt::LIST_META_CONTEXT, name_and_queries(name, queries))
            }
            ClientOption::SetMetaContext { name, queries } => (opt::SET_META_CONTEXT, name_and_queries(name, queries)),
            ClientOption::Unknown(code) => (*code, vec![]),
        }
    }
}

/// What the server knows about one export, as negotiation needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportDesc {
    pub name: String,
    pub size: u64,
    pub read_only: bool,
    pub description: String,
    /// Block size constraints: minimum, preferred, maximum.
    pub min_block: u32,
    pub pref_block: u32,
    pub max_block: u32,
}

impl ExportDesc {
    /// The transmission flags this server sends for the export.
    pub fn tx_flags(&self) -> u16 {
        use tx_flags::*;
        let mut f = HAS_FLAGS | SEND_FLUSH | SEND_FUA | SEND_DF | CAN_MULTI_CONN | SEND_CACHE;
        if self.read_only {
            f |= READ_ONLY;
        } else {
            f |= SEND_TRIM | SEND_WRITE_ZEROES | SEND_FAST_ZERO;
        }
        f
    }
}

/// Where the negotiator looks exports up.
pub trait ExportCatalog {
    /// Describes the export `name`, or says why it cannot be served.
    fn lookup(&self, name: &str) -> Result<ExportDesc, String>;
    /// Names of all exports, for `NBD_OPT_LIST`.
    fn names(&self) -> Vec<String>;
}

/// What the caller does after an option was handled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Send the output and read the next option.
    Continue,
    /// Send the output (the `NBD_REP_ACK` of `NBD_OPT_STARTTLS`), then run
    /// a TLS handshake as the server; the next option comes inside TLS. If
    /// the handshake fails, close.
    StartTls,
    /// Send the output and enter transmission on this export.
    Transmit(ExportDesc),
    /// Send the output (if any) and close the connection.
    Close,
}

/// Whether the server offers TLS, and whether it insists on it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum TlsMode {
    /// No TLS: `NBD_OPT_STARTTLS` gets `NBD_REP_ERR_UNSUP` (NOTLS).
    #[default]
    Off,
    /// TLS at the client's choice; plain clients are served too (SELECTIVETLS).
    Allow,
    /// Every option but `NBD_OPT_STARTTLS` and `NBD_OPT_ABORT` gets
    /// `NBD_REP_ERR_TLS_REQD` until TLS runs (FORCEDTLS).
    Require,
}

impl std::str::FromStr for TlsMode {
    type Err = String;

    /// `off`, `allow` (or nbdkit's `on`) and `require`.
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "off" => Ok(TlsMode::Off),
            "allow" | "on" => Ok(TlsMode::Allow),
            "require" => Ok(TlsMode::Require),
            other => Err(format!("unknown TLS mode {other:?}: expected \"require\", \"allow\" or \"off\"")),
        }
    }
}

impl std::fmt::Display for TlsMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TlsMode::Off => "off",
            TlsMode::Allow => "allow",
            TlsMode::Require => "require",
        })
    }
}

/// What a server offers beyond the base protocol. CoronaFS's own server
/// offers everything ([`Offer::default`]); a proxy that forwards only some
/// commands to a server of its own (PlasmaVMC's `nbd-front`) offers less,
/// and refuses the rest instead of accepting what it cannot do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Offer {
    /// `NBD_OPT_EXTENDED_HEADERS` is acknowledged; without it the option
    /// gets `NBD_REP_ERR_UNSUP`.
    pub extended_headers: bool,
    /// The `base:allocation` metadata context is offered; without it
    /// `NBD_OPT_LIST_META_CONTEXT` and `NBD_OPT_SET_META_CONTEXT` get
    /// `NBD_REP_ERR_UNSUP`.
    pub base_allocation: bool,
    /// The transmission flags that may be announced: the export's
    /// ([`ExportDesc::tx_flags`]) are cut to these.
    pub tx_flags: u16,
}

impl Default for Offer {
    fn default() -> Self {
        Offer { extended_headers: true, base_allocation: true, tx_flags: u16::MAX }
    }
}

/// The server's negotiation state for one connection.
#[derive(Debug, Default, Clone)]
pub struct Negotiator {
    /// Client asked for no 124 zero bytes after `NBD_OPT_EXPORT_NAME`.
    pub no_zeroes: bool,
    /// Structured replies were negotiated.
    pub structured: bool,
    /// Extended headers were negotiated (they imply structured replies).
    pub extended: bool,
    /// `base:allocation` was selected, and for which export name.
    pub meta_export: Option<String>,
    /// The TLS policy for this connection.
    pub tls: TlsMode,
    /// `NBD_OPT_STARTTLS` was acknowledged: everything since runs in TLS.
    pub tls_active: bool,
    /// What this server offers.
    pub offer: Offer,
}

/// Outcome of negotiation that transmission needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Negotiated {
    pub export: ExportDesc,
    /// Simple, structured or extended replies (and request headers).
    pub mode: ReplyMode,
    pub base_allocation: bool,
    /// The connection runs in TLS.
    pub tls: bool,
}

impl Negotiator {
    /// A negotiation without TLS.
    pub fn new(client_flags: u32) -> Self {
        Self::with_tls(client_flags, TlsMode::Off)
    }

    /// A negotiation under a TLS policy. A client that did not answer fixed
    /// newstyle may not be offered TLS (the spec's NOTLS rule): under
    /// `Allow` it negotiates as with `Off`; under `Require` it is refused.
    pub fn with_tls(client_flags: u32, tls: TlsMode) -> Self {
        let fixed = client_flags & client_flags::FIXED_NEWSTYLE != 0;
        let tls = if !fixed && tls == TlsMode::Allow { TlsMode::Off } else { tls };
        Negotiator { no_zeroes: client_flags & client_flags::NO_ZEROES != 0, tls, ..Default::default() }
    }

    /// The same negotiation offering only `offer`.
    pub fn offering(self, offer: Offer) -> Self {
        Negotiator { offer, ..self }
    }

    /// The transmission flags announced for `desc`.
    pub fn tx_flags(&self, desc: &ExportDesc) -> u16 {
        desc.tx_flags() & self.offer.tx_flags
    }

    /// Handles one option, appending any reply to `out`.
    pub fn handle(&mut self, code: u32, data: &[u8], cat: &dyn ExportCatalog, out: &mut Vec<u8>) -> Step {
        if self.tls == TlsMode::Require && !self.tls_active {
            match code {
                opt::STARTTLS | opt::ABORT => {}
                // NBD_OPT_EXPORT_NAME cannot be answered with an error: the spec says to close.
                opt::EXPORT_NAME => return Step::Close,
                _ => {
                    let msg = "this server requires TLS: send NBD_OPT_STARTTLS first (an nbds:// URI)";
                    error_reply(code, rep::ERR_TLS_REQD, msg, out);
                    return Step::Continue;
                }
            }
        }
        let parsed = match ClientOption::parse(code, data) {
            Ok(o) => o,
            Err(e) => {
                if code == opt::EXPORT_NAME {
                    // NBD_OPT_EXPORT_NAME has no error reply: the spec says to close.
                    return Step::Close;
                }
                error_reply(code, rep::ERR_INVALID, &e.to_string(), out);
                return Step::Continue;
            }
        };
        match parsed {
            ClientOption::ExportName(name) => match cat.lookup(&name) {
                Ok(desc) => {
                    out.extend_from_slice(&desc.size.to_be_bytes());
                    out.extend_from_slice(&self.tx_flags(&desc).to_be_bytes());
                    if !self.no_zeroes {
                        out.extend_from_slice(&[0u8; 124]);
                    }
                    self.clear_meta_unless(&name);
                    Step::Transmit(desc)
                }
                Err(_) => Step::Close,
            },
            ClientOption::Abort => {
                encode_option_reply(code, rep::ACK, &[], out);
                Step::Close
            }
            ClientOption::List => {
                for name in cat.names() {
                    let mut d = Vec::with_capacity(4 + name.len());
                    d.extend_from_slice(&(name.len() as u32).to_be_bytes());
                    d.extend_from_slice(name.as_bytes());
                    encode_option_reply(code, rep::SERVER, &d, out);
                }
                encode_option_reply(code, rep::ACK, &[], out);
                Step::Continue
            }
            ClientOption::StartTls => {
                if self.tls == TlsMode::Off {
                    error_reply(code, rep::ERR_UNSUP, "TLS is off on this server (coronafs serve --tls)", out);
                    return Step::Continue;
                }
                if self.tls_active {
                    error_reply(code, rep::ERR_INVALID, "TLS is already running", out);
                    return Step::Continue;
                }
                // Nothing negotiated in the clear survives the upgrade (the spec's rule).
                self.structured = false;
                self.extended = false;
                self.meta_export = None;
                self.tls_active = true;
                encode_option_reply(code, rep::ACK, &[], out);
                Step::StartTls
            }
            ClientOption::StructuredReply => {
                if self.extended {
                    let msg = "extended headers are already negotiated and take precedence";
                    error_reply(code, rep::ERR_EXT_HEADER_REQD, msg, out);
                    return Step::Continue;
                }
                self.structured = true;
                encode_option_reply(code, rep::ACK, &[], out);
                Step::Continue
            }
            ClientOption::ExtendedHeaders => {
                if !self.offer.extended_headers {
                    error_reply(code, rep::ERR_UNSUP, "extended headers are not offered by this server", out);
                    return Step::Continue;
                }
                self.extended = true;
                encode_option_reply(code, rep::ACK, &[], out);
                Step::Continue
            }
            ClientOption::Info { name, requests } | ClientOption::Go { name, requests } => {
                let desc = match cat.lookup(&name) {
                    Ok(d) => d,
                    Err(why) => {
                        error_reply(code, rep::ERR_UNKNOWN, &why, out);
                        return Step::Continue;
                    }
                };
                encode_info_replies(code, &desc, self.tx_flags(&desc), &requests, out);
                encode_option_reply(code, rep::ACK, &[], out);
                if code == opt::GO {
                    self.clear_meta_unless(&name);
                    Step::Transmit(desc)
                } else {
                    Step::Continue
                }
            }
            ClientOption::ListMetaContext { name, queries } | ClientOption::SetMetaContext { name, queries } => {
                if !self.offer.base_allocation {
                    error_reply(code, rep::ERR_UNSUP, "this server offers no metadata context", out);
                    return Step::Continue;
                }
                let set = code == opt::SET_META_CONTEXT;
                if set && !self.structured && !self.extended {
                    let msg = "structured replies or extended headers must be negotiated first";
                    error_reply(code, rep::ERR_INVALID, msg, out);
                    return Step::Continue;
                }
                if let Err(why) = cat.lookup(&name) {
                    error_reply(code, rep::ERR_UNKNOWN, &why, out);
                    return Step::Continue;
                }
                let matched = if queries.is_empty() {
                    !set
                } else {
                    queries.iter().any(|q| q == BASE_ALLOCATION || (!set && (q == "base:" || q.is_empty())))
                };
                if set {
                    self.meta_export = if matched { Some(name) } else { None };
                }
                if matched {
                    let mut d = Vec::with_capacity(4 + BASE_ALLOCATION.len());
                    d.extend_from_slice(&BASE_ALLOCATION_ID.to_be_bytes());
                    d.extend_from_slice(BASE_ALLOCATION.as_bytes());
                    encode_option_reply(code, rep::META_CONTEXT, &d, out);
                }
                encode_option_reply(code, rep::ACK, &[], out);
                Step::Continue
            }
            ClientOption::Unknown(_) => {
                error_reply(code, rep::ERR_UNSUP, "option not supported", out);
                Step::Continue
            }
        }
    }

    /// Meta contexts are bound to the export they were set for.
    fn clear_meta_unless(&mut self, name: &str) {
        if self.meta_export.as_deref() != Some(name) {
            self.meta_export = None;
        }
    }

    /// The replies negotiated so far.
    pub fn mode(&self) -> ReplyMode {
        match (self.extended, self.structured) {
            (true, _) => ReplyMode::Extended,
            (false, true) => ReplyMode::Structured,
            (false, false) => ReplyMode::Simple,
        }
    }

    /// What transmission needs to know, once `Step::Transmit` came back.
    pub fn finish(&self, export: ExportDesc) -> Negotiated {
        let mode = self.mode();
        Negotiated {
            base_allocation: mode != ReplyMode::Simple && self.meta_export.as_deref() == Some(export.name.as_str()),
            mode,
            export,
            tls: self.tls_active,
        }
    }
}

/// Appends an error reply with a human-readable message.
pub fn error_reply(code: u32, reply: u32, msg: &str, out: &mut Vec<u8>) {
    let msg = &msg.as_bytes()[..msg.len().min(MAX_STRING)];
    encode_option_reply(code, reply, msg, out);
}

fn encode_info_replies(code: u32, desc: &ExportDesc, tx_flags: u16, requests: &[u16], out: &mut Vec<u8>) {
    let mut d = Vec::with_capacity(14);
    d.extend_from_slice(&info::EXPORT.to_be_bytes());
    d.extend_from_slice(&desc.size.to_be_bytes());
    d.extend_from_slice(&tx_flags.to_be_bytes());
    encode_option_reply(code, rep::INFO, &d, out);
    // Block sizes are sent whether asked or not: the spec allows it, and it
    // tells clients our maximum payload.
    d.clear();
    d.extend_from_slice(&info::BLOCK_SIZE.to_be_bytes());
    d.extend_from_slice(&desc.min_block.to_be_bytes());
    d.extend_from_slice(&desc.pref_block.to_be_bytes());
    d.extend_from_slice(&desc.max_block.to_be_bytes());
    encode_option_reply(code, rep::INFO, &d, out);
    if requests.contains(&info::NAME) {
        d.clear();
        d.extend_from_slice(&info::NAME.to_be_bytes());
        d.extend_from_slice(desc.name.as_bytes());
        encode_option_reply(code, rep::INFO, &d, out);
    }
    if requests.contains(&info::DESCRIPTION) && !desc.description.is_empty() {
        d.clear();
        d.extend_from_slice(&info::DESCRIPTION.to_be_bytes());
        d.extend_from_slice(desc.description.as_bytes());
        encode_option_reply(code, rep::INFO, &d, out);
    }
}

/// An `NBD_REP_INFO` payload decoded by a client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InfoItem {
    Export { size: u64, flags: u16 },
    Name(String),
    Description(String),
    BlockSize { min: u32, pref: u32, max: u32 },
    Other(u16),
}

/// Decodes an `NBD_REP_INFO` payload.
pub fn decode_info(d: &[u8]) -> Result<InfoItem, ProtoError> {
    if d.len() < 2 {
        return Err(ProtoError::Truncated { need: 2, have: d.len() });
    }
    let want = |n: usize| {
        if d.len() == n { Ok(()) } else { Err(ProtoError::BadLength("info item has the wrong size")) }
    };
    let text = || std::str::from_utf8(&d[2..]).map(str::to_owned).map_err(|_| ProtoError::BadString("not UTF-8"));
    match be_u16(d, 0) {
        info::EXPORT => {
            want(12)?;
            Ok(InfoItem::Export { size: be_u64(d, 2), flags: be_u16(d, 10) })
        }
        info::NAME => Ok(InfoItem::Name(text()?)),
        info::DESCRIPTION => Ok(InfoItem::Description(text()?)),
        info::BLOCK_SIZE => {
            want(14)?;
            Ok(InfoItem::BlockSize { min: be_u32(d, 2), pref: be_u32(d, 6), max: be_u32(d, 10) })
        }
        other => Ok(InfoItem::Other(other)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    struct One;
    impl ExportCatalog for One {
        fn lookup(&self, name: &str) -> Result<ExportDesc, String> {
            if name == "vol" {
                Ok(ExportDesc {
                    name: "vol".into(),
                    size: 1 << 20,
                    read_only: false,
                    description: String::new(),
                    min_block: 1,
                    pref_block: 4096,
                    max_block: 1 << 25,
                })
            } else {
                Err(format!("no export named {name:?}"))
            }
        }
        fn names(&self) -> Vec<String> {
            vec!["vol".into()]
        }
    }

    fn reply_types(out: &[u8]) -> Vec<u32> {
        let mut v = Vec::new();
        let mut pos = 0;
        while pos < out.len() {
            let h: &[u8; 20] = out[pos..pos + 20].try_into().unwrap();
            let (_, t, len) = decode_option_reply_header(h).unwrap();
            v.push(t);
            pos += 20 + len as usize;
        }
        v
    }

    #[test]
    fn unknown_option_gets_err_unsup_and_negotiation_continues() {
        let mut n = Negotiator::new(client_flags::FIXED_NEWSTYLE);
        let mut out = Vec::new();
        assert_eq!(n.handle(0xdead, b"xyz", &One, &mut out), Step::Continue);
        assert_eq!(reply_types(&out), vec![rep::ERR_UNSUP]);
    }

    #[test]
    fn go_on_a_missing_export_is_err_unknown_with_a_message() {
        let mut n = Negotiator::new(0);
        let mut out = Vec::new();
        let (code, data) = ClientOption::Go { name: "nope".into(), requests: vec![] }.encode_payload();
        assert_eq!(n.handle(code, &data, &One, &mut out), Step::Continue);
        assert_eq!(reply_types(&out), vec![rep::ERR_UNKNOWN]);
        assert!(String::from_utf8_lossy(&out[20..]).contains("nope"));
    }

    #[test]
    fn set_meta_context_needs_structured_replies_first() {
        let mut n = Negotiator::new(0);
        let mut out = Vec::new();
        let q = ClientOption::SetMetaContext { name: "vol".into(), queries: vec![BASE_ALLOCATION.into()] };
        let (code, data) = q.encode_payload();
        n.handle(code, &data, &One, &mut out);
        assert_eq!(reply_types(&out), vec![rep::ERR_INVALID]);
        out.clear();
        n.handle(opt::STRUCTURED_REPLY, &[], &One, &mut out);
        out.clear();
        n.handle(code, &data, &One, &mut out);
        assert_eq!(reply_types(&out), vec![rep::META_CONTEXT, rep::ACK]);
        out.clear();
        let (code, data) = ClientOption::Go { name: "vol".into(), requests: vec![] }.encode_payload();
        let Step::Transmit(desc) = n.handle(code, &data, &One, &mut out) else { panic!("no transmit") };
        assert!(n.finish(desc).base_allocation);
    }

    #[test]
    fn meta_context_is_dropped_when_go_names_another_export() {
        let mut n = Negotiator::new(0);
        n.structured = true;
        n.meta_export = Some("other".into());
        let mut out = Vec::new();
        let (code, data) = ClientOption::Go { name: "vol".into(), requests: vec![] }.encode_payload();
        let Step::Transmit(desc) = n.handle(code, &data, &One, &mut out) else { panic!("no transmit") };
        assert!(!n.finish(desc).base_allocation);
    }

    #[test]
    fn export_name_for_a_missing_export_closes() {
        let mut n = Negotiator::new(0);
        let mut out = Vec::new();
        assert_eq!(n.handle(opt::EXPORT_NAME, b"missing", &One, &mut out), Step::Close);
        assert!(out.is_empty());
    }

    #[test]
    fn export_name_sends_size_flags_and_zero_padding_unless_no_zeroes() {
        for (flags, len) in [(0, 134), (client_flags::NO_ZEROES, 10)] {
            let mut n = Negotiator::new(flags);
            let mut out = Vec::new();
            assert!(matches!(n.handle(opt::EXPORT_NAME, b"vol", &One, &mut out), Step::Transmit(_)));
            assert_eq!(out.len(), len);
            assert_eq!(be_u64(&out, 0), 1 << 20);
        }
    }

    #[test]
    fn list_names_every_export_then_acks() {
        let mut n = Negotiator::new(0);
        let mut out = Vec::new();
        n.handle(opt::LIST, &[], &One, &mut out);
        assert_eq!(reply_types(&out), vec![rep::SERVER, rep::ACK]);
        out.clear();
        n.handle(opt::LIST, b"junk", &One, &mut out);
        assert_eq!(reply_types(&out), vec![rep::ERR_INVALID]);
    }

    fn tls_server(flags: u32, mode: TlsMode) -> Negotiator {
        Negotiator::with_tls(flags | client_flags::FIXED_NEWSTYLE, mode)
    }

    fn send(n: &mut Negotiator, o: &ClientOption) -> (Step, Vec<u32>) {
        let (code, data) = o.encode_payload();
        let mut out = Vec::new();
        let step = n.handle(code, &data, &One, &mut out);
        let types =
            if matches!(step, Step::Transmit(_)) && code == opt::EXPORT_NAME { vec![] } else { reply_types(&out) };
        (step, types)
    }

    #[test]
    fn starttls_with_tls_off_is_err_unsup_and_plain_negotiation_goes_on() {
        let mut n = tls_server(0, TlsMode::Off);
        assert_eq!(send(&mut n, &ClientOption::StartTls), (Step::Continue, vec![rep::ERR_UNSUP]));
        let go = ClientOption::Go { name: "vol".into(), requests: vec![] };
        let (step, _) = send(&mut n, &go);
        let Step::Transmit(desc) = step else { panic!("no transmit: {step:?}") };
        assert!(!n.finish(desc).tls);
    }

    #[test]
    fn require_refuses_everything_but_starttls_and_abort_before_tls() {
        let mut n = tls_server(0, TlsMode::Require);
        for o in [
            ClientOption::List,
            ClientOption::StructuredReply,
            ClientOption::ExtendedHeaders,
            ClientOption::Info { name: "vol".into(), requests: vec![] },
            ClientOption::Go { name: "vol".into(), requests: vec![] },
            ClientOption::Go { name: "missing".into(), requests: vec![] },
            ClientOption::SetMetaContext { name: "vol".into(), queries: vec![BASE_ALLOCATION.into()] },
            ClientOption::Unknown(99),
        ] {
            assert_eq!(send(&mut n, &o), (Step::Continue, vec![rep::ERR_TLS_REQD]), "{o:?}");
        }
        // Even a malformed option: TLS comes first.
        let mut out = Vec::new();
        assert_eq!(n.handle(opt::LIST, b"junk", &One, &mut out), Step::Continue);
        assert_eq!(reply_types(&out), vec![rep::ERR_TLS_REQD]);
        assert!(!n.structured && !n.extended, "nothing was negotiated in the clear");
        // NBD_OPT_EXPORT_NAME has no error reply: the connection closes, even for a real export.
        let mut out = Vec::new();
        assert_eq!(n.handle(opt::EXPORT_NAME, b"vol", &One, &mut out), Step::Close);
        assert!(out.is_empty());
        let mut n = tls_server(0, TlsMode::Require);
        assert_eq!(send(&mut n, &ClientOption::Abort), (Step::Close, vec![rep::ACK]));
    }

    #[test]
    fn starttls_acks_then_options_run_and_a_second_starttls_is_invalid() {
        for mode in [TlsMode::Allow, TlsMode::Require] {
            let mut n = tls_server(0, mode);
            assert_eq!(send(&mut n, &ClientOption::StartTls), (Step::StartTls, vec![rep::ACK]), "{mode}");
            assert!(n.tls_active);
            assert_eq!(send(&mut n, &ClientOption::StartTls), (Step::Continue, vec![rep::ERR_INVALID]), "{mode}");
            assert_eq!(send(&mut n, &ClientOption::List), (Step::Continue, vec![rep::SERVER, rep::ACK]), "{mode}");
            let (step, _) = send(&mut n, &ClientOption::Go { name: "vol".into(), requests: vec![] });
            let Step::Transmit(desc) = step else { panic!("no transmit under {mode}: {step:?}") };
            assert!(n.finish(desc).tls);
        }
        // A STARTTLS with a payload is malformed, not an upgrade.
        let mut n = tls_server(0, TlsMode::Require);
        let mut out = Vec::new();
        assert_eq!(n.handle(opt::STARTTLS, b"x", &One, &mut out), Step::Continue);
        assert_eq!(reply_types(&out), vec![rep::ERR_INVALID]);
        assert!(!n.tls_active);
    }

    #[test]
    fn starttls_forgets_what_was_negotiated_in_the_clear() {
        let mut n = tls_server(0, TlsMode::Allow);
        send(&mut n, &ClientOption::ExtendedHeaders);
        send(&mut n, &ClientOption::SetMetaContext { name: "vol".into(), queries: vec![BASE_ALLOCATION.into()] });
        assert_eq!(n.mode(), ReplyMode::Extended);
        assert_eq!(send(&mut n, &ClientOption::StartTls).0, Step::StartTls);
        assert_eq!((n.mode(), n.meta_export.clone()), (ReplyMode::Simple, None));
    }

    #[test]
    fn allow_serves_plain_clients_and_a_client_without_fixed_newstyle_gets_no_tls() {
        let mut n = tls_server(0, TlsMode::Allow);
        assert_eq!(send(&mut n, &ClientOption::List).1, vec![rep::SERVER, rep::ACK]);
        assert!(matches!(
            send(&mut n, &ClientOption::Go { name: "vol".into(), requests: vec![] }).0,
            Step::Transmit(_)
        ));
        // Non-fixed newstyle: NOTLS under allow, refused under require.
        let mut n = Negotiator::with_tls(0, TlsMode::Allow);
        assert_eq!(send(&mut n, &ClientOption::StartTls).1, vec![rep::ERR_UNSUP]);
        let mut n = Negotiator::with_tls(0, TlsMode::Require);
        let mut out = Vec::new();
        assert_eq!(n.handle(opt::EXPORT_NAME, b"vol", &One, &mut out), Step::Close);
    }

    #[test]
    fn extended_headers_take_precedence_over_structured_replies() {
        let mut n = Negotiator::new(client_flags::FIXED_NEWSTYLE);
        assert_eq!(send(&mut n, &ClientOption::ExtendedHeaders), (Step::Continue, vec![rep::ACK]));
        assert_eq!(send(&mut n, &ClientOption::StructuredReply).1, vec![rep::ERR_EXT_HEADER_REQD]);
        let q = ClientOption::SetMetaContext { name: "vol".into(), queries: vec![BASE_ALLOCATION.into()] };
        assert_eq!(send(&mut n, &q).1, vec![rep::META_CONTEXT, rep::ACK], "extended headers allow meta contexts");
        let (step, _) = send(&mut n, &ClientOption::Go { name: "vol".into(), requests: vec![] });
        let Step::Transmit(desc) = step else { panic!("no transmit") };
        let done = n.finish(desc);
        assert_eq!((done.mode, done.base_allocation), (ReplyMode::Extended, true));
        // Structured first, then extended: extended wins.
        let mut n = Negotiator::new(client_flags::FIXED_NEWSTYLE);
        send(&mut n, &ClientOption::StructuredReply);
        assert_eq!(send(&mut n, &ClientOption::ExtendedHeaders).1, vec![rep::ACK]);
        assert_eq!(n.mode(), ReplyMode::Extended);
        let mut out = Vec::new();
        n.handle(opt::EXTENDED_HEADERS, b"x", &One, &mut out);
        assert_eq!(reply_types(&out), vec![rep::ERR_INVALID], "the option takes no payload");
    }

    #[test]
    fn a_server_offering_less_refuses_extended_headers_and_meta_contexts_and_announces_only_its_flags() {
        let offer = Offer {
            extended_headers: false,
            base_allocation: false,
            tx_flags: tx_flags::HAS_FLAGS | tx_flags::SEND_FLUSH | tx_flags::SEND_FUA,
        };
        let mut n = Negotiator::new(client_flags::FIXED_NEWSTYLE).offering(offer);
        assert_eq!(send(&mut n, &ClientOption::ExtendedHeaders), (Step::Continue, vec![rep::ERR_UNSUP]));
        assert_eq!(send(&mut n, &ClientOption::StructuredReply), (Step::Continue, vec![rep::ACK]));
        for q in [
            ClientOption::SetMetaContext { name: "vol".into(), queries: vec![BASE_ALLOCATION.into()] },
            ClientOption::ListMetaContext { name: "vol".into(), queries: vec![] },
        ] {
            assert_eq!(send(&mut n, &q), (Step::Continue, vec![rep::ERR_UNSUP]), "{q:?}");
        }
        let (code, data) = ClientOption::Go { name: "vol".into(), requests: vec![] }.encode_payload();
        let mut out = Vec::new();
        let Step::Transmit(desc) = n.handle(code, &data, &One, &mut out) else { panic!("no transmit") };
        let done = n.finish(desc);
        assert_eq!((done.mode, done.base_allocation), (ReplyMode::Structured, false));
        // The first INFO reply is the export's size and flags.
        let flags = be_u16(&out, 20 + 10);
        assert_eq!(flags, tx_flags::HAS_FLAGS | tx_flags::SEND_FLUSH | tx_flags::SEND_FUA);
        // EXPORT_NAME announces the same flags.
        let mut n = Negotiator::new(client_flags::NO_ZEROES).offering(offer);
        let mut out = Vec::new();
        assert!(matches!(n.handle(opt::EXPORT_NAME, b"vol", &One, &mut out), Step::Transmit(_)));
        assert_eq!(be_u16(&out, 8), tx_flags::HAS_FLAGS | tx_flags::SEND_FLUSH | tx_flags::SEND_FUA);
    }

    fn arb_option() -> impl Strategy<Value = ClientOption> {
        let s = "[a-z@:._-]{0,40}";
        prop_oneof![
            s.prop_map(ClientOption::ExportName),
            Just(ClientOption::Abort),
            Just(ClientOption::List),
            Just(ClientOption::StartTls),
            Just(ClientOption::StructuredReply),
            Just(ClientOption::ExtendedHeaders),
            (s, prop::collection::vec(any::<u16>(), 0..8))
                .prop_map(|(name, requests)| ClientOption::Info { name, requests }),
            (s, prop::collection::vec(any::<u16>(), 0..8))
                .prop_map(|(name, requests)| ClientOption::Go { name, requests }),
            (s, prop::collection::vec(s, 0..4))
                .prop_map(|(name, queries)| ClientOption::ListMetaContext { name, queries }),
            (s, prop::collection::vec(s, 0..4))
                .prop_map(|(name, queries)| ClientOption::SetMetaContext { name, queries }),
            (12u32..1000).prop_map(ClientOption::Unknown),
        ]
    }

    proptest! {
        #[test]
        fn option_roundtrips(o in arb_option()) {
            let (code, data) = o.encode_payload();
            prop_assert_eq!(ClientOption::parse(code, &data).unwrap(), o);
        }

        #[test]
        fn any_option_bytes_parse_or_error_never_panic(code in 0u32..16, data in prop::collection::vec(any::<u8>(), 0..300)) {
            let _ = ClientOption::parse(code, &data);
            let mut n = Negotiator::new(0);
            let mut out = Vec::new();
            let _ = n.handle(code, &data, &One, &mut out);
        }

        /// Under `require`, any sequence of options before STARTTLS gets
        /// nothing but ERR_TLS_REQD (or the close of EXPORT_NAME / ABORT);
        /// after it, none gets ERR_TLS_REQD and another STARTTLS is invalid.
        #[test]
        fn require_holds_every_option_until_starttls(
            before in prop::collection::vec(arb_option(), 0..12),
            after in prop::collection::vec(arb_option(), 0..12),
        ) {
            let mut n = tls_server(0, TlsMode::Require);
            for o in &before {
                let (step, types) = send(&mut n, o);
                match o {
                    ClientOption::StartTls => break,
                    ClientOption::ExportName(_) => { prop_assert_eq!(step, Step::Close); return Ok(()); }
                    ClientOption::Abort => { prop_assert_eq!((step, types), (Step::Close, vec![rep::ACK])); return Ok(()); }
                    _ => prop_assert_eq!((step, types), (Step::Continue, vec![rep::ERR_TLS_REQD]), "{:?}", o),
                }
            }
            prop_assert_eq!(n.mode(), ReplyMode::Simple);
            prop_assert!(n.meta_export.is_none());
            if !n.tls_active {
                prop_assert_eq!(send(&mut n, &ClientOption::StartTls), (Step::StartTls, vec![rep::ACK]));
            }
            for o in &after {
                let (step, types) = send(&mut n, o);
                prop_assert!(!types.contains(&rep::ERR_TLS_REQD), "{:?} got ERR_TLS_REQD inside TLS", o);
                if *o == ClientOption::StartTls {
                    prop_assert_eq!(types, vec![rep::ERR_INVALID]);
                }
                if step != Step::Continue {
                    prop_assert!(step != Step::StartTls, "a second STARTTLS upgraded");
                    break;
                }
            }
        }

        #[test]
        fn any_info_bytes_decode_or_error(data in prop::collection::vec(any::<u8>(), 0..40)) {
            let _ = decode_info(&data);
        }
    }
}
