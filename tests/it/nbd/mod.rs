//! CoronaFS through real NBD clients and its control API.

mod durability;
mod faults;
mod front;
mod interop;
mod server;
mod tls;
mod volumes;
