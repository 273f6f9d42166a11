//! The host network model: desired and observed state of links, addresses, routes and rules.
